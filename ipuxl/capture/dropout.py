"""Randomness in a captured module: a pure function of a seed input, as in PopXL.

While a module is traced, ``F.dropout`` (and ``dropout1d/2d/3d``, and the attention
dropout of ``F.scaled_dot_product_attention``, which then runs as its math) is
replaced by a product with a mask from the seeded ``ipuxl::dropout_mask`` op (an
in-place ``mul_`` for ``inplace=True``, as eager's ``dropout_``), and torch's random
functions (``torch.rand``, ``normal``, ``Tensor.bernoulli_``... see
``capture.random_ops``) by seeded draws: the k-th draw of the module, dropouts and
random functions in call order, gets seed ``modify_seed(seed, k)`` (``DropoutMode``).
An aten random op that reaches a trace some other way is refused (``random_op``
finds it): it would draw from torch's global generator, not ``Options.randomSeed``.

The seed is a graph input of shape ``SEED_SHAPE`` (two non-negative 31-bit words,
``seed_words``); a training step derives one seed per micro-batch from it
(``step_seeds``). ``DropoutReplay`` runs eager PyTorch with the same masks and draws.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import ipuxl.ops.random  # noqa: F401  (registers the ipuxl::* random custom ops)
from ipuxl.capture import random_ops
from ipuxl.errors import OpArgumentError, TraceError
from ipuxl.ir.context import user_source_line

__all__ = ["SEED_SHAPE", "SEED_DTYPE", "seed_words", "step_seeds", "DropoutMode", "DropoutReplay", "random_op",
           "ATTENTION_ARGS", "ATTENTION_DEFAULTS"]

SEED_SHAPE: tuple[int, ...] = (2,)
SEED_DTYPE = torch.int64

# the dropout functions seeded here (``_mask_shape`` gives each one's mask shape)
_DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d})
_RANDOM_OPS = ("rand", "randn", "randint", "randperm", "bernoulli", "normal", "uniform", "multinomial",
               "exponential", "geometric", "cauchy", "log_normal", "native_dropout", "poisson", "rrelu")
ATTENTION_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
ATTENTION_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def seed_words(random_seed: int) -> np.ndarray:
    """The device seed (two non-negative 31-bit words) for ``Options.randomSeed(random_seed)``."""
    return np.asarray([random_seed & 0x7FFFFFFF, (random_seed >> 31) & 0x7FFFFFFF], np.int64)


def step_seeds(seed: torch.Tensor, micro_batches: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One training step's seed schedule: ``(next step's seed, one seed per micro-batch)``.

    The device program runs the same ops (``ops.split_random_seed``) on its seed
    variable; ``DropoutReplay`` runs them eagerly.
    """
    following, this_step = (torch.ops.ipuxl.modify_seed(seed, i) for i in range(2))
    if micro_batches == 1:
        return following, [this_step]
    return following, [torch.ops.ipuxl.modify_seed(this_step, i) for i in range(micro_batches)]


class DropoutMode(TorchFunctionMode):
    """Runs every dropout and random function with numbers drawn from ``seed`` (see the
    module docstring); meanwhile ``torch.distributions`` run as a capture can run them
    (``random_ops.capturable_distributions``).

    Attributes:
        seed: the seed tensor the masks and draws derive from.
        n_dropouts: draws (dropouts and random functions) so far; the next one uses
            ``modify_seed(seed, n_dropouts + 1)``.
    """

    def __init__(self, seed: torch.Tensor):
        super().__init__()
        self.seed = seed
        self.n_dropouts = 0

    def __enter__(self) -> "DropoutMode":
        self._distributions = random_ops.capturable_distributions()
        self._distributions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._distributions.__exit__(*exc)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.call(func, args, kwargs or {})

    def call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` with its dropouts and random draws seeded."""
        if func in _DROPOUTS:
            return self._dropout(func, args, kwargs)
        if func in random_ops.RANDOM_FUNCTIONS:
            return random_ops.draw(func, self.next_seed, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(func, args, kwargs)
        if func is F.multi_head_attention_forward:  # its attention dropout is a nested call: route it here
            sdpa = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = lambda *a, **k: self._attention(sdpa, a, k)
            try:
                return func(*args, **kwargs)
            finally:
                F.scaled_dot_product_attention = sdpa
        return func(*args, **kwargs)

    def next_seed(self) -> torch.Tensor:
        """The seed of the next draw: ``modify_seed(seed, k)`` for the k-th draw."""
        self.n_dropouts += 1
        return torch.ops.ipuxl.modify_seed(self.seed, self.n_dropouts)

    def skip_dropouts(self, count: int) -> torch.Tensor:
        """The seed of a called block that makes ``count`` draws (dropouts and random functions):
        this mode's seed shifted past the draws so far (``ops.random.offset_seed``); its draws
        count as drawn."""
        seed = torch.ops.ipuxl.offset_seed(self.seed, self.n_dropouts)
        self.n_dropouts += count
        return seed

    def _attention(self, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` with dropout: its math, with the mask drawn by
        ``_dropout`` (seeded) instead of the fused kernel's own generator."""
        a: dict[str, Any] = dict(zip(ATTENTION_ARGS, ATTENTION_DEFAULTS))
        a.update(zip(ATTENTION_ARGS, args))
        a.update(kwargs)
        if not a["dropout_p"]:
            return func(*args, **kwargs)
        q: torch.Tensor = a["query"]
        k: torch.Tensor = a["key"]
        v: torch.Tensor = a["value"]
        if a["enable_gqa"] and k.size(-3) != q.size(-3):
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
            v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
        scale = a["scale"] if a["scale"] is not None else q.size(-1) ** -0.5
        weights = (q @ k.transpose(-2, -1)) * scale
        if a["is_causal"]:
            causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
            weights = weights.masked_fill(~causal, float("-inf"))
        mask: torch.Tensor | None = a["attn_mask"]
        if mask is not None:
            weights = weights.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else weights + mask
        weights = self._dropout(F.dropout, (torch.softmax(weights, dim=-1), float(a["dropout_p"])), {"training": True})
        return weights @ v

    def _dropout(self, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        """``F.dropout`` (or ``dropout1d/2d/3d``) as eager runs it, with a seeded mask; with
        ``inplace=True`` the input is multiplied in place, as eager's ``dropout_`` does (a
        functional ``mul`` once functionalized, which autodiff can differentiate)."""
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        x, p, training = bound.arguments["input"], float(bound.arguments["p"]), bound.arguments["training"]
        if not 0.0 <= p <= 1.0:
            raise OpArgumentError(f"{func.__name__}: dropout probability has to be between 0 and 1, but got {p}",
                                  where=user_source_line(), fix="pass a probability p in [0, 1]")
        shape = _mask_shape(func, x)
        if not training or p == 0.0:
            return x
        mask = 0.0 if p == 1.0 else torch.ops.ipuxl.dropout_mask(self.next_seed(), shape, p, x.dtype)
        if isinstance(mask, torch.Tensor) and mask.device != x.device:
            mask = mask.to(x.device)  # a replay's seed is on the CPU: the masks are the same on every device
        return x.mul_(mask) if bound.arguments.get("inplace") else x * mask


def _mask_shape(func: Callable, x: torch.Tensor) -> list[int]:
    """The shape of the mask eager's ``func`` draws for ``x``: one value per element
    (``F.dropout``), else per channel: ``feature_dropout`` on ``(N, C, ...)``, or on
    ``(C, ...)`` for unbatched input of ``dropout1d`` (2-D) and ``dropout3d`` (4-D).

    Raises:
        TraceError: ``dropout1d`` of an input that is not 2-D or 3-D (eager's RuntimeError).
    """
    if func is F.dropout:
        return list(x.shape)
    if func is F.dropout1d and x.dim() not in (2, 3):
        raise TraceError(f"dropout1d: expected a 2-D or 3-D input, got a {x.dim()}-D input of shape "
                         f"{tuple(x.shape)}", where=user_source_line(),
                         fix="pass (C, L) or (N, C, L), or use F.dropout for element-wise dropout")
    unbatched = {F.dropout1d: 2, F.dropout3d: 4}.get(func) == x.dim()
    kept = 1 if unbatched else 2
    return [*x.shape[:kept], *[1] * (x.dim() - kept)]


class DropoutReplay:
    """Eager PyTorch with the masks and random draws a ``trainingModel`` makes, to compare the
    two step by step (``torch.rand``, ``Tensor.bernoulli_``... draw what the device draws).
    Dropout masks are the device's whichever device either side runs on (``kernels.counter_random``);
    torch's random functions are drawn on the CPU, so they match a model run on the CPU.

    Example:
        >>> replay = DropoutReplay(random_seed=42)
        >>> for x, y in micro_batches:           # one eager optimiser step each
        ...     with replay.step():
        ...         out, loss = model(x, y)      # F.dropout uses the device's mask
    """

    def __init__(self, random_seed: int, gradient_accumulation: int = 1):
        self._seed = torch.from_numpy(seed_words(random_seed))
        self._accumulation = gradient_accumulation
        self._pending: list[torch.Tensor] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Run one micro-batch's forward (and backward) with the device's dropout seed."""
        if not self._pending:
            self._seed, self._pending = step_seeds(self._seed, self._accumulation)
        with DropoutMode(self._pending.pop(0)):
            yield


def random_op(gm: fx.GraphModule) -> str | None:
    """The name of the first unseeded aten random op in a traced graph (``"bernoulli"``), or None."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            op = node.target._schema.name.split("::")[-1].rstrip("_")
            if node.target.namespace == "aten" and any(op == r or op.startswith(r + "_") for r in _RANDOM_OPS):
                return op
    return None
