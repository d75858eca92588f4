"""Capture an ``nn.Module`` (PopTorch style) into an IR graph with torch.fx.

``trace_module`` runs the module once on fake tensors under ``make_fx``: every aten
op it executes becomes one fx node, so any module that traces works, not a fixed
list of layers. The traced function is ``functional_call(module, params, buffers,
inputs)`` under ``torch.func.functionalize``, so

* parameters and buffers are *inputs* of the graph (the caller binds them to
  variables), and
* in-place updates of buffers (BatchNorm's running statistics) become *extra
  outputs* holding the new values, which the caller writes back to the variables.

Randomness is made a pure function of a seed input, as in PopXL: ``F.dropout``
(and ``dropout1d/2d/3d``, and the attention dropout of
``F.scaled_dot_product_attention``, which then runs as its math) is replaced while
tracing by a mask from the seeded ``ipuxl::dropout_mask`` op, the k-th dropout of
the module getting seed ``modify_seed(seed, k)``. Other random ops are refused (they would draw from
torch's global generator and not be reproducible under ``Options.randomSeed``).

The loss is found as PopTorch finds it: the output produced by a torch loss
function (``F.cross_entropy``, ``nn.MSELoss``...) or marked with
``ipuxl.identity_loss``; failing that, the single scalar float output.

``graph_from_trace`` then copies the traced fx body into an ``Ir`` subgraph
(inputs: user inputs, parameters, buffers, seed; outputs: user outputs flattened,
then new buffer values), ready for ``transforms.autodiff`` and ``ops.call``.
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

import ipuxl.ops.random  # noqa: F401  (registers the ipuxl::* random custom ops)
from ipuxl.capture.grad_mode import NOT_HANDLED, GradTracker
from ipuxl.errors import TraceError
from ipuxl.ir.call_op import CallEntry, is_call_graph_node
from ipuxl.ir.context import traceback_source_line, user_source_line
from ipuxl.ir.fx_import import copy_fx_body
from ipuxl.ir.tensor import TensorSpec
from ipuxl.ir.calls import MIN_SAVINGS  # what an outlined block must save over all its copies

__all__ = ["TracedModule", "trace_module", "graph_from_trace", "identity_loss", "SEED_SHAPE", "seed_words",
           "DropoutReplay"]

SEED_SHAPE, SEED_DTYPE = (2,), torch.int64

_aten = torch.ops.aten
# BatchNorm's aten kernel mutates its running statistics without declaring it, so
# functionalize cannot see the update; its decomposition updates them visibly.
_DECOMPOSITIONS = get_decompositions([_aten.native_batch_norm.default])

_LOSS_FUNCTIONS = frozenset(
    getattr(F, name) for name in dir(F)
    if name.endswith("_loss") or name in ("cross_entropy", "binary_cross_entropy",
                                          "binary_cross_entropy_with_logits", "kl_div"))
_DROPOUTS = {F.dropout: 0, F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3}
_RANDOM_OPS = ("rand", "randn", "randint", "randperm", "bernoulli", "normal", "uniform", "multinomial",
               "exponential", "geometric", "cauchy", "log_normal", "native_dropout", "poisson", "rrelu")

_state = threading.local()


def identity_loss(x: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """Mark ``x`` as the loss to differentiate (PopTorch's ``identity_loss``).

    Args:
        x: the loss, or per-sample losses to reduce.
        reduction: ``"sum"``, ``"mean"`` or ``"none"`` (``x`` is already the loss).

    Eagerly (outside a traced model) it just returns the reduced ``x``.
    """
    if reduction not in ("sum", "mean", "none"):
        raise TraceError(f"identity_loss: reduction must be 'sum', 'mean' or 'none', got {reduction!r}",
                         where=user_source_line(), fix="pass reduction='mean' (or 'sum' / 'none')")
    out = x.sum() if reduction == "sum" else x.mean() if reduction == "mean" else x
    marks = getattr(_state, "marked", None)
    if marks is not None:
        marks.append(out)
    return out


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


class DropoutReplay:
    """Eager PyTorch with the masks a ``trainingModel`` draws, to compare the two step by step.

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
        with _CaptureMode(self._pending.pop(0), "eager"):
            yield


@dataclass
class TracedModule:
    """The fx graph of one module call and how its inputs and outputs map back.

    Graph inputs, in order: ``inputs`` (tensor leaves of the call's arguments),
    ``params``, ``buffers``, then the seed when ``uses_seed``. Graph outputs: the
    user's output leaves (``out_spec`` rebuilds the structure), then the new values
    of ``mutated`` parameters/buffers.
    """

    gm: fx.GraphModule
    name: str
    input_names: list[str]
    input_specs: list[TensorSpec]
    params: list[str]
    buffers: list[str]
    uses_seed: bool
    out_spec: Any
    output_specs: list[TensorSpec]
    loss_index: int | None
    mutated: list[str] = field(default_factory=list)
    # the non-tensor leaves of the call, part of the program (a change means a new trace)
    static_args: tuple = ()
    n_dropouts: int = 0  # dropouts drawn per call (each takes the next seed modifier)
    has_losses: bool = False  # a loss function or identity_loss ran inside
    # positions (in ``inputs``) of the call's tensors written in place; their new values
    # are the last graph outputs, after those of ``mutated``
    mutated_inputs: list[int] = field(default_factory=list)
    # repeated block modules traced once and called from the graph (``outline=True``)
    blocks: list["OutlinedBlock"] = field(default_factory=list)

    @property
    def n_outputs(self) -> int:
        return len(self.output_specs)

    @property
    def mutates_inputs(self) -> bool:
        """An in-place write to one of the call's own inputs."""
        return bool(self.mutated_inputs)


class _CaptureMode(TorchFunctionMode):
    """Seeds dropout and records which tensors came out of loss functions."""

    def __init__(self, seed: torch.Tensor, module_name: str, grads: GradTracker | None = None):
        super().__init__()
        self.seed = seed
        self.n_dropouts = 0
        self.losses: list[torch.Tensor] = []
        self.module_name = module_name
        self.grads = grads  # eager autograd semantics while tracing (see capture.grad_mode)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        grads = self.grads
        if grads is None:
            return self._call(func, args, kwargs)
        answer = grads.intercept(func, args, kwargs)
        if answer is not NOT_HANDLED:
            return answer
        args, kwargs = grads.prepare(func, args, kwargs)
        out = self._call(func, args, kwargs)
        grads.record(func, args, kwargs, out)
        return out

    def _call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if func in _DROPOUTS:
            return self._dropout(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(func, args, kwargs)
        if func is F.multi_head_attention_forward:  # its attention dropout is a nested call: route it here
            sdpa = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = lambda *a, **k: self._attention(sdpa, a, k)
            try:
                return func(*args, **kwargs)
            finally:
                F.scaled_dot_product_attention = sdpa
        out = func(*args, **kwargs)
        if func in _LOSS_FUNCTIONS:
            self.losses.append(out)
        return out

    def _attention(self, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` with dropout: its math, with the mask drawn by
        ``_dropout`` (seeded) instead of the fused kernel's own generator."""
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, (None, None, None, None, 0.0, False, None, False)))
        a.update(zip(names, args))
        a.update(kwargs)
        if not a["dropout_p"]:
            return func(*args, **kwargs)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if a["enable_gqa"] and k.size(-3) != q.size(-3):
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
            v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
        scale = a["scale"] if a["scale"] is not None else q.size(-1) ** -0.5
        weights = (q @ k.transpose(-2, -1)) * scale
        if a["is_causal"]:
            causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
            weights = weights.masked_fill(~causal, float("-inf"))
        if mask is not None:
            weights = weights.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else weights + mask
        weights = self._dropout(F.dropout, (torch.softmax(weights, dim=-1), float(a["dropout_p"])), {"training": True})
        return weights @ v

    def _dropout(self, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        x, p, training = bound.arguments["input"], float(bound.arguments["p"]), bound.arguments["training"]
        if not training or p == 0.0:
            return x
        if p == 1.0:
            return x * 0.0
        self.n_dropouts += 1
        seed = torch.ops.ipuxl.modify_seed(self.seed, self.n_dropouts)
        feature_dims = _DROPOUTS[func]
        shape = list(x.shape) if feature_dims == 0 else list(x.shape[:-feature_dims]) + [1] * feature_dims
        out = x * torch.ops.ipuxl.dropout_mask(seed, shape, p, x.dtype)
        if bound.arguments.get("inplace"):
            x.copy_(out)
            return x
        return out


def trace_module(module: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                 training: bool, need_loss: bool, outline: bool = False) -> TracedModule:
    """Trace ``module(*args, **kwargs)`` (see the module docstring).

    Args:
        training: trace in training mode (dropout on, BatchNorm batch statistics)
            or in eval mode; the module's own flags are restored afterwards.
        need_loss: find the loss output (``TraceError`` when there is none).
        outline: trace each kind of repeated block module once and record its other
            runs as calls of that trace (see ``OutlinedBlock``), so capture time and
            graph size grow with the number of distinct blocks, not of blocks.
    """
    candidates = _outline_candidates(module) if outline else {}
    blocks: dict[Any, OutlinedBlock | None] = {}
    if candidates:
        _discover_blocks(module, args, kwargs, training, candidates, blocks)
    while True:
        try:
            traced = _trace(module, args, kwargs, training=training, need_loss=need_loss,
                            candidates=candidates, blocks=blocks)
        except _NeedBlock as need:  # the first run of a kind of block: trace it alone, then start again
            blocks[need.key] = _trace_block(need, training, candidates)
            continue
        traced.blocks = _used_blocks(traced.gm, blocks)
        return traced


def _trace(module: torch.nn.Module, args: tuple, kwargs: dict | None, *, training: bool, need_loss: bool,
           candidates: dict[torch.nn.Module, Any], blocks: dict[Any, "OutlinedBlock | None"]) -> TracedModule:
    name = type(module).__name__
    bound, leaves, in_spec, tensor_pos = _flatten_call(module, module.forward, args, kwargs)
    arg_names = list(bound.arguments)
    input_names = _input_names(bound, arg_names)
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    p_names, b_names = list(params), list(buffers)
    record: dict[str, Any] = {}

    def fn(inputs: list[torch.Tensor], p_vals: list[torch.Tensor], b_vals: list[torch.Tensor],
           seed: torch.Tensor) -> list[torch.Tensor]:
        call_leaves = list(leaves)
        for pos, value in zip(tensor_pos, inputs):
            call_leaves[pos] = value
        call_args, call_kwargs = pytree.tree_unflatten(call_leaves, in_spec)
        trainable = [v for n, v in zip(p_names, p_vals) if params[n].requires_grad and v.is_floating_point()]
        mode = _CaptureMode(seed, name, GradTracker(trainable, differentiated=training))
        _state.marked, _state.mode = [], mode
        # a training step differentiates its forward whatever the caller's grad mode
        grad_mode = torch.enable_grad() if training else contextlib.nullcontext()
        try:
            with grad_mode, mode, _outlined_blocks(candidates, blocks):
                out = torch.func.functional_call(module, {**dict(zip(p_names, p_vals)), **dict(zip(b_names, b_vals))},
                                                 call_args, call_kwargs, tie_weights=True, strict=False)
            marked = list(_state.marked)
        finally:
            _state.marked = _state.mode = None
        flat, out_spec = pytree.tree_flatten(out)
        bad = [type(v).__name__ for v in flat if not isinstance(v, torch.Tensor)]
        if bad:
            raise TraceError(f"{name}.forward returned non-tensor values ({', '.join(bad)})",
                             where=_forward_source(module),
                             fix="return tensors (or tuples/lists/dicts of tensors) from forward")
        record.update(out_spec=out_spec, n_dropouts=mode.n_dropouts, has_losses=bool(marked or mode.losses),
                      loss_index=_find_loss(flat, marked, mode.losses) if need_loss else None)
        return flat

    example = [leaves[i] for i in tensor_pos]
    flags = {m: m.training for m in module.modules()}
    module.train(training)
    try:
        gm = make_fx(torch.func.functionalize(fn, remove="mutations"), tracing_mode="fake",
                     decomposition_table=_DECOMPOSITIONS, record_stack_traces=True)(
            [t.detach() for t in example], [p.detach() for p in params.values()],
            [b.detach() for b in buffers.values()], torch.zeros(SEED_SHAPE, dtype=SEED_DTYPE))
    except (TraceError, _NeedBlock):
        raise
    except Exception as exc:  # torch raises many kinds while tracing; all mean "cannot capture this"
        raise _trace_error(name, exc) from None
    finally:
        for m, flag in flags.items():
            m.training = flag
    mutated, mutated_inputs = _extract_mutations(gm, len(example), p_names + b_names)
    _refuse_random_ops(gm, name, module)
    out_vals = [n.meta["val"] for n in gm.graph.output_node().args[0]]
    n_user = len(out_vals) - len(mutated) - len(mutated_inputs)
    traced = TracedModule(
        gm=gm, name=name, input_names=input_names,
        input_specs=[TensorSpec(tuple(t.shape), t.dtype) for t in example], params=p_names, buffers=b_names,
        uses_seed=record["n_dropouts"] > 0, out_spec=record["out_spec"],
        output_specs=[TensorSpec(tuple(v.shape), v.dtype) for v in out_vals[:n_user]],
        loss_index=record["loss_index"], mutated=mutated,
        static_args=tuple((i, _static_key(leaf)) for i, leaf in enumerate(leaves) if i not in tensor_pos),
        n_dropouts=record["n_dropouts"], has_losses=record["has_losses"], mutated_inputs=mutated_inputs)
    if need_loss:
        _check_loss(traced, module)
    return traced


def _flatten_call(module: torch.nn.Module, forward: Callable, args: tuple,
                  kwargs: dict | None) -> tuple[inspect.BoundArguments, list, Any, list[int]]:
    """Bind a call of ``forward``; its pytree leaves, spec and the tensor leaves' positions."""
    try:
        bound = inspect.signature(forward).bind(*args, **dict(kwargs or {}))
    except TypeError as exc:
        name = type(module).__name__
        raise TraceError(f"cannot call {name}.forward with the given inputs: {exc}", where=user_source_line(),
                         fix=f"pass the arguments {name}.forward takes") from None
    leaves, in_spec = pytree.tree_flatten((tuple(bound.args), dict(bound.kwargs)))
    return bound, leaves, in_spec, [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]


# -- outlining repeated block modules while tracing --------------------------------------------
MIN_BLOCK_OPS = 4  # smaller blocks stay inline: a call costs more than it saves and stops fusion


@dataclass
class OutlinedBlock:
    """A kind of block module traced once; ``entry`` records its calls in the model's trace.

    The block's graph (``graph_from_trace(ir, traced)``) takes the call's tensor
    inputs, the block's parameters and buffers, then (when it draws random numbers)
    a seed: the model's seed shifted by the dropouts that ran before the call
    (``ops.random.offset_seed``), so masks equal the inlined module's.
    """

    traced: TracedModule
    entry: CallEntry

    def call(self, module: torch.nn.Module, tensors: list[torch.Tensor]) -> Any:
        traced, mode = self.traced, _state.mode
        extra = []
        if traced.uses_seed:
            extra = [torch.ops.ipuxl.offset_seed(mode.seed, mode.n_dropouts)]
            mode.n_dropouts += traced.n_dropouts
        state = [_member(module, n) for n in traced.params + traced.buffers]
        outs = self.entry(*tensors, *state, *extra)
        for name, new in zip(traced.mutated, outs[traced.n_outputs:]):
            _member(module, name).copy_(new)  # functionalize turns this into the model's buffer update
        return pytree.tree_unflatten(list(outs[:traced.n_outputs]), traced.out_spec)


class _NeedBlock(Exception):
    """Raised inside a trace at the first run of a kind of block not traced yet."""

    def __init__(self, key: Any, module: torch.nn.Module, args: tuple, kwargs: dict):
        super().__init__(type(module).__name__)
        self.key, self.module, self.args, self.kwargs = key, module, args, kwargs


def _member(module: torch.nn.Module, dotted: str) -> torch.Tensor:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module  # type: ignore[return-value]


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def _structure(module: torch.nn.Module, memo: dict[torch.nn.Module, Any]) -> Any:
    """What makes two module instances compute the same function of their inputs and
    state: class, plain attributes, parameter and buffer specs, children (recursively).
    None when that cannot be told (hooks, a per-instance forward, unhashable state)."""
    if module in memo:
        return memo[module]
    memo[module] = None
    if (module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module)
            or getattr(module, "_forward_hooks_with_kwargs", None)):
        return None
    attrs = [(key, _attr_key(value)) for key, value in vars(module).items()
             if key not in _MODULE_INTERNALS and not key.startswith("_ipuxl")]
    state = tuple((kind, name, None if t is None else (tuple(t.shape), t.dtype))
                  for kind, members in (("p", module._parameters), ("b", module._buffers))
                  for name, t in members.items())
    children = []
    for name, child in module._modules.items():
        key = None if child is None else _structure(child, memo)
        if key is None and child is not None:
            return None
        children.append((name, key))
    memo[module] = (type(module), tuple(sorted(attrs, key=repr)), state, tuple(children))
    return memo[module]


def _attr_key(value: Any) -> Any:
    """Plain values compare by value (containers item by item); any other object by identity."""
    if isinstance(value, (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, type)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_attr_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((_attr_key(k), _attr_key(v)) for k, v in value.items()))
    return ("id", id(value))  # tensors, functions, other objects: the same one only


def _outline_candidates(root: torch.nn.Module) -> dict[torch.nn.Module, tuple[Any, int]]:
    """Outermost submodules with at least one structurally identical sibling instance:
    ``{module: (structure key, number of instances of that structure)}``."""
    memo: dict[torch.nn.Module, Any] = {}
    named = [(name, m) for name, m in root.named_modules() if m is not root]
    keys = {m: _structure(m, memo) for _, m in named}
    counts: dict[Any, int] = {}
    for key in keys.values():
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    repeated = {name: m for name, m in named if keys[m] is not None and counts[keys[m]] > 1}
    return {m: (keys[m], counts[keys[m]]) for name, m in repeated.items()
            if not any(name.startswith(other + ".") for other in repeated)}


@contextlib.contextmanager
def _outlined_blocks(candidates: dict[torch.nn.Module, Any], blocks: dict[Any, OutlinedBlock | None]) -> Iterator[None]:
    """Route each candidate's forward through its traced block while tracing the model."""
    for module, (structure, _) in candidates.items():
        module.forward = _block_forward(module, structure, blocks)
    try:
        yield
    finally:
        for module in candidates:
            vars(module).pop("forward", None)


def _block_forward(module: torch.nn.Module, structure: Any, blocks: dict[Any, OutlinedBlock | None]) -> Callable:
    original = type(module).forward.__get__(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        _, leaves, in_spec, tensor_pos = _flatten_call(module, original, args, kwargs)
        key = (structure, str(in_spec), tuple(_static_key(v) for i, v in enumerate(leaves) if i not in tensor_pos),
               tuple((tuple(leaves[i].shape), leaves[i].dtype) for i in tensor_pos))
        if key not in blocks:
            raise _NeedBlock(key, module, args, kwargs)
        block = blocks[key]
        if block is None:
            return original(*args, **kwargs)
        return block.call(module, [leaves[i] for i in tensor_pos])

    return forward


def _discover_blocks(module: torch.nn.Module, args: tuple, kwargs: dict | None, training: bool,
                     candidates: dict[torch.nn.Module, tuple[Any, int]],
                     blocks: dict[Any, OutlinedBlock | None]) -> None:
    """Find the kinds of blocks the model runs, and trace each alone, by running the model
    on meta tensors (no tracing, so cheap); the model's trace then meets known blocks only.
    Anything meta tensors cannot run leaves the rest to the retries of ``trace_module``."""
    def meta(value: Any) -> Any:
        return torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, torch.Tensor) else value

    state = {name: meta(t) for name, t in [*module.named_parameters(), *module.named_buffers()]}
    meta_args, meta_kwargs = pytree.tree_map(meta, (tuple(args), dict(kwargs or {})))
    flags = {m: m.training for m in module.modules()}
    module.train(training)
    try:
        for _ in range(len(candidates) + 1):
            mode = _CaptureMode(torch.zeros(SEED_SHAPE, dtype=SEED_DTYPE, device="meta"), type(module).__name__)
            _state.marked, _state.mode = [], mode
            try:
                with torch.no_grad(), mode, _outlined_blocks(candidates, blocks):
                    torch.func.functional_call(module, state, meta_args, meta_kwargs, tie_weights=True, strict=False)
                return
            except _NeedBlock as need:
                _state.marked = _state.mode = None
                blocks[need.key] = _trace_block(need, training, candidates)
    except Exception:  # noqa: BLE001 - an op without a meta kernel, data-dependent code...: trace instead
        return
    finally:
        _state.marked = _state.mode = None
        for m, flag in flags.items():
            m.training = flag


def _trace_block(need: _NeedBlock, training: bool,
                 candidates: dict[torch.nn.Module, tuple[Any, int]]) -> OutlinedBlock | None:
    """Trace one block module alone; None (run it inline) when outlining it would not pay
    or would change what the model computes."""
    def example(value: Any) -> Any:
        return torch.zeros(value.shape, dtype=value.dtype) if isinstance(value, torch.Tensor) else value

    args, kwargs = pytree.tree_map(example, (need.args, need.kwargs))
    try:
        traced = trace_module(need.module, args, kwargs, training=training, need_loss=False)
    except TraceError:
        return None  # traced inline, where the model's trace reports any real problem
    ops = sum(1 for n in traced.gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
    copies = candidates[need.module][1]
    if traced.has_losses or traced.mutates_inputs or ops < MIN_BLOCK_OPS or ops * (copies - 1) < MIN_SAVINGS:
        return None
    outputs = [TensorSpec(tuple(n.meta["val"].shape), n.meta["val"].dtype)
               for n in traced.gm.graph.output_node().args[0]]
    return OutlinedBlock(traced, CallEntry(traced.name, outputs))


def _used_blocks(gm: fx.GraphModule, blocks: dict[Any, OutlinedBlock | None]) -> list[OutlinedBlock]:
    keys = {n.args[0] for n in gm.graph.nodes if is_call_graph_node(n)}
    return [b for b in blocks.values() if b is not None and b.entry.key in keys]


def _input_names(bound: inspect.BoundArguments, arg_names: list[str]) -> list[str]:
    names = []
    for key, value in bound.arguments.items():
        leaves = pytree.tree_leaves(value)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if len(tensors) == 1 and isinstance(value, torch.Tensor):
            names.append(key)
        else:
            names.extend(f"{key}.{k}" for k in range(len(tensors)))
    return names


def _static_key(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def _find_loss(flat: list[torch.Tensor], marked: list[torch.Tensor], losses: list[torch.Tensor]) -> int | None:
    for group in (marked, losses):
        hits = [i for i, v in enumerate(flat) if any(v is m for m in group)]
        if hits:
            return hits[-1] if len(hits) == 1 else -len(hits)  # negative: ambiguous
    scalars = [i for i, v in enumerate(flat) if v.dim() == 0 and v.dtype.is_floating_point]
    return scalars[0] if len(scalars) == 1 else (None if not scalars else -len(scalars))


def _check_loss(traced: TracedModule, module: torch.nn.Module) -> None:
    index = traced.loss_index
    shapes = [s.shape for s in traced.output_specs]
    if index is None:
        raise TraceError(
            f"training model {traced.name} returns no loss (outputs of shapes {shapes})",
            where=_forward_source(module),
            fix="return the loss from forward, e.g. `return output, loss` with loss from a torch loss "
                "function, or wrap a custom loss with ipuxl.identity_loss(loss, reduction='mean'); "
                "or pass loss=torch.nn.CrossEntropyLoss() to trainingModel")
    if index < 0:
        raise TraceError(
            f"training model {traced.name} returns {-index} tensors that could each be the loss "
            f"(outputs of shapes {shapes})", where=_forward_source(module),
            fix="mark the one to minimise with ipuxl.identity_loss(loss, reduction='none')")
    spec = traced.output_specs[index]
    if spec.shape != () or not spec.dtype.is_floating_point:
        raise TraceError(
            f"the loss of {traced.name} (output {index}) must be a float scalar, got shape {spec.shape} "
            f"{spec.dtype}", where=_forward_source(module),
            fix="reduce it, e.g. ipuxl.identity_loss(loss, reduction='mean')")


def _forward_source(module: torch.nn.Module) -> str | None:
    try:
        fn = type(module).forward
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]} in {type(module).__name__}.forward"
    except (OSError, TypeError):
        return None


def _trace_error(name: str, exc: Exception) -> TraceError:
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    kind = type(exc).__name__ + " " + str(exc)
    if any(k in kind for k in ("DataDependent", "data-dependent", "data dependent", "GuardOnDataDependent",
                               "item()", "Could not guard", "_local_scalar_dense")):
        fix = ("tensor values are not known while capturing: replace Python control flow on tensor values "
               "and .item()/.tolist()/bool(tensor) by tensor ops (torch.where, masks), or do that work on the host")
    else:
        fix = "rewrite that line with standard torch ops; this op or construct cannot be captured by torch.fx"
    return TraceError(f"cannot capture module {name} with torch.fx: {text}",
                      where=traceback_source_line(exc.__traceback__), fix=fix)


def _extract_mutations(gm: fx.GraphModule, n_inputs: int, state_names: list[str]) -> tuple[list[str], list[int]]:
    """Turn functionalize's trailing ``copy_(dst, new)`` into extra outputs.

    Returns the mutated parameter/buffer names (their new values follow the user's
    outputs, in this order) and the positions of the call's own tensor inputs written
    in place (their new values come last, so the caller's tensors can be updated)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state_nodes = {node: state_names[i] for i, node in enumerate(placeholders[n_inputs:n_inputs + len(state_names)])}
    input_nodes = {node: i for i, node in enumerate(placeholders[:n_inputs])}
    output = gm.graph.output_node()
    outs = list(output.args[0])
    mutated, input_news = [], {}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _aten.copy_.default:
            dst, src = node.args
            if dst in state_nodes:
                mutated.append(state_nodes[dst])
                outs.append(src)
                gm.graph.erase_node(node)
            elif dst in input_nodes:
                input_news[input_nodes[dst]] = src
                gm.graph.erase_node(node)
    mutated_inputs = sorted(input_news)
    outs.extend(input_news[i] for i in mutated_inputs)
    output.args = (outs,)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return mutated, mutated_inputs


def _refuse_random_ops(gm: fx.GraphModule, name: str, module: torch.nn.Module) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            op = node.target._schema.name.split("::")[-1].rstrip("_")
            if node.target.namespace == "aten" and any(op == r or op.startswith(r + "_") for r in _RANDOM_OPS):
                raise TraceError(
                    f"module {name} uses the random op aten.{op}, which would not be reproducible on the device",
                    where=_forward_source(module),
                    fix="use nn.Dropout / F.dropout (seeded by ipuxl from Options.randomSeed), or generate the "
                        "random values on the host and pass them as an input")


def graph_from_trace(ir: Any, traced: TracedModule) -> Any:
    """A new subgraph of ``ir`` computing ``traced`` (see ``TracedModule`` for the interface).

    Each outlined block becomes one subgraph of its own, called from every place it ran.
    """
    for block in traced.blocks:
        block.entry.graph = graph_from_trace(ir, block.traced)
    graph = ir.new_subgraph(traced.name)
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    names = traced.input_names + traced.params + traced.buffers + ["seed"]
    env: dict[fx.Node, fx.Node] = {}
    for node, input_name in zip(placeholders, names):
        if input_name == "seed" and not traced.uses_seed:
            continue
        val = node.meta["val"]
        env[node] = graph.add_input(TensorSpec(tuple(val.shape), val.dtype), input_name).node
    copy_fx_body(traced.gm, graph.fx, env, graph.constants, ir)
    out_names = ([f"output{i}" for i in range(traced.n_outputs)] + [f"{m}.new" for m in traced.mutated]
                 + [f"{traced.input_names[i]}.new" for i in traced.mutated_inputs])
    outputs = []
    for node, out_name in zip(traced.gm.graph.output_node().args[0], out_names):
        new = env[node]
        if new.op != "placeholder":
            new.meta["ipuxl_name"] = out_name
        outputs.append(graph.wrap(new))
    graph.set_outputs(outputs)
    return graph
