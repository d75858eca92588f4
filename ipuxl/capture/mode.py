"""What a module's forward does differently while it is captured, and how the loss is found.

``CaptureMode`` is the torch function mode a trace runs under: it seeds dropout
(``DropoutMode``), gives autograd its eager meaning (``capture.grad_mode``), makes
tensors from outside the module constants (``capture.constants``) and records the
tensors that came out of torch loss functions; in-place composites that functionalize
refuses run as the ops they stand for (``capture.inplace``); the IPU's device names
(``device="ipu"`` / ``"xla"``) mean the capture's device (``capture.devices``).
``capturing`` makes it the active capture, which ``identity_loss``, outlined blocks and
``poptorch._impl.isDispatchTracing`` consult.

The loss is found as PopTorch finds it (``find_loss``): of the losses (outputs of a
torch loss function, ``F.cross_entropy``, ``nn.MSELoss``..., or marked with
``ipuxl.identity_loss``), the one no other loss is computed from (``capture.losses``);
failing that, the single scalar float output. One tensor returned at several positions
is one candidate.

``Precision`` holds PopTorch's float16 rules for a capture (``Options.Precision``):
with ``downcast_to_half`` (``HalfFloatCastingBehavior.FloatDowncastToHalf``) an op
whose floating-point operands mix float16 and float32 gets its float32 operands cast
to float16 (the tensor an in-place op writes, and batch norm's running statistics,
keep their dtype); with ``upcast_to_float`` (``HalfUpcastToFloat``, PopTorch 3's
default) the float16 operands are cast to float32 instead, as PyTorch's promotion
rules give for elementwise ops, for every op: a float16 model's matmul or
convolution then takes float32 activations (where eager PyTorch refuses the mix), as
PopTorch's dispatcher does. Operands of no dimensions take no part in the decision
(``a_float16 * torch.tensor(2.0)`` stays float16, as eager).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from ipuxl.capture.causal_masks import causal_mask_hints
from ipuxl.capture.compiling import compiling_state
from ipuxl.capture.custom_functions import intercepting_functions
from ipuxl.capture.constants import OutsideTensors
from ipuxl.capture.ctc_loss import CTC_FUNCTIONS, ctc_loss
from ipuxl.capture.devices import on_capture_device
from ipuxl.capture.dropout import ATTENTION_ARGS, ATTENTION_DEFAULTS, DropoutMode
from ipuxl.capture.failures import eager_error, refuse_tensor_slice
from ipuxl.capture.flex_attention import flex_attention_as_math
from ipuxl.capture.grad_mode import NOT_HANDLED, REQUIRES, GradTracker, is_inplace
from ipuxl.capture.inplace import REPLACEMENTS as INPLACE_REPLACEMENTS
from ipuxl.capture.losses import LossCandidates
from ipuxl.capture.known_values import NOT_KNOWN, KnownValues
from ipuxl.capture.meta_checks import int_conditions
from ipuxl.capture.mutable_ops import call_functionally, call_out_variant, refused_out_variant, written_arguments
from ipuxl.capture.reductions import NOT_PROD, static_prod
from ipuxl.capture.runtime_checks import assert_statements
from ipuxl.errors import IpuxlError, OpArgumentError, TraceError
from ipuxl.ir.context import user_source_line
from ipuxl.kernels.checks import one_hot as checked_one_hot
from ipuxl.kernels.grad_hooks import Hook, new_hook

__all__ = ["CaptureMode", "Precision", "capturing", "active_mode", "identity_loss", "find_loss"]

_LOSS_FUNCTIONS = frozenset(
    getattr(F, name) for name in dir(F)
    if name.endswith("_loss") or name in ("cross_entropy", "binary_cross_entropy",
                                          "binary_cross_entropy_with_logits", "kl_div"))

_state = threading.local()  # the active CaptureMode of this thread (``capturing``)

# conversions keep their meaning: their operands are never downcast
_CONVERSIONS = frozenset({torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as, torch.Tensor.copy_})
# normalisations whose running statistics (arguments 1 and 2) keep their dtype
_RUNNING_STATISTICS = frozenset({F.batch_norm, torch.batch_norm, F.instance_norm, torch.instance_norm})


@dataclass(frozen=True)
class Precision:
    """PopTorch's float16 rules for a capture (see the module docstring).

    Attributes:
        downcast_to_half: cast float32 operands of ops mixing float16 and float32 to float16.
        upcast_to_float: cast float16 operands of ops mixing float16 and float32 to float32.
        float_statistics: batch norm running statistics of float16 modules are traced
            (and kept on the device) in float32 (``runningStatisticsAlwaysFloat``).
    """

    downcast_to_half: bool = False
    float_statistics: bool = False
    upcast_to_float: bool = False


class CaptureMode(DropoutMode):
    """Seeds dropout, applies eager autograd rules and records candidate losses.

    Attributes:
        losses: results of torch loss functions, in call order.
        marked: tensors marked with ``identity_loss``, in call order.
        grads: the eager autograd semantics while tracing (None: leave grad mode alone).
        outside: the constants standing for tensors from outside the module (meta
            tensors when ``seed`` is one: a dry run on meta tensors).
    """

    def __init__(self, seed: torch.Tensor, grads: GradTracker | None = None, precision: Precision = Precision()):
        super().__init__(seed)
        self.losses: list[torch.Tensor] = []
        self.marked: list[torch.Tensor] = []
        self.candidates = LossCandidates()  # both, and which losses each tensor uses (``capture.losses``)
        self.grads = grads
        self.precision = precision
        self.outside = OutsideTensors(to_meta=seed.device.type == "meta")
        # real values of tensors computed from constants (none in a dry run on meta tensors)
        self.known = None if seed.device.type == "meta" else KnownValues()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        args, kwargs = self.outside.lift(func, *on_capture_device(func, args, kwargs or {}))
        if self.known is not None:
            answer = self.known.read(func, args, kwargs)
            if answer is not NOT_KNOWN:
                return answer
        out = self._dispatch(func, args, kwargs)
        self.candidates.follow((args, kwargs), out)
        if self.known is not None:
            self.known.record(func, args, kwargs, out)
        return out

    def _dispatch(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if self.precision.downcast_to_half or self.precision.upcast_to_float:
            args, kwargs = self.downcast(func, args, kwargs)
        grads = self.grads
        if func is torch.Tensor.register_hook:
            return self.register_hook(args[0], *args[1:], **kwargs)
        if grads is None:
            return self.call_checked(func, args, kwargs)
        answer = grads.intercept(func, args, kwargs)
        if answer is not NOT_HANDLED:
            return answer
        args, kwargs = grads.prepare(func, args, kwargs)
        out = static_prod(func, args, kwargs) if grads.differentiated else NOT_PROD
        if out is NOT_PROD:
            out = self.call_checked(func, args, kwargs)
        grads.record(func, args, kwargs, out)
        return out

    def register_hook(self, tensor: torch.Tensor, hook: Callable) -> Hook:
        """``tensor.register_hook(hook)``: in a trace that is differentiated, a marker that puts
        the hook on the tensor's gradient (``kernels.grad_hooks``); the handle's ``remove()``
        takes it off. Eager's error for a tensor that does not require grad."""
        requires = bool(self.grads.flags(tensor) & REQUIRES) if self.grads is not None else tensor.requires_grad
        if not requires:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        record = new_hook(hook, user_source_line())
        if self.grads is not None and self.grads.differentiated:
            torch.ops.ipuxl.grad_hook(record.key, tensor)
        return record

    def downcast(self, func: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``func``'s operands with float32 tensors cast to float16 when they mix with
        float16 ones (``HalfFloatCastingBehavior.FloatDowncastToHalf``), or float16 ones
        to float32 (``upcast_to_float``); a cast operand keeps its autograd state, so
        gradients reach the parameters in their own dtype."""
        if func in _CONVERSIONS:
            return args, kwargs
        kept = {id(args[0])} if args and is_inplace(func) else set()
        if func in _RUNNING_STATISTICS:
            kept |= {id(v) for v in (*args[1:3], kwargs.get("running_mean"), kwargs.get("running_var"))}
        leaves = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor) and id(v) not in kept]
        if self.precision.upcast_to_float:
            leaves = [v for v in leaves if v.dim() > 0]
        if not {torch.float16, torch.float32} <= {v.dtype for v in leaves}:
            return args, kwargs
        source, target = ((torch.float16, torch.float32) if self.precision.upcast_to_float
                          else (torch.float32, torch.float16))

        def cast(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or value.dtype != source or id(value) in kept:
                return value
            if self.precision.upcast_to_float and value.dim() == 0:
                return value
            converted = value.to(target)
            if self.grads is not None:
                self.grads.state[converted] = self.grads.flags(value)
            return converted

        return pytree.tree_map(cast, (args, kwargs))

    def call_checked(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``call``; a failure raises the error eager PyTorch raises for the same call, when
        there is one (meta kernels word theirs differently; see ``capture.failures``)."""
        try:
            return self.call(func, args, kwargs)
        except IpuxlError:
            raise
        except Exception as exc:
            if refused_out_variant(kwargs, exc):  # ``torch.matmul(a, b, out=t)``
                return call_out_variant(self.call, func, args, kwargs, self.grads, exc)
            refuse_tensor_slice(func, args, exc)
            eager = eager_error(func, args, kwargs, exc)
            if eager is None:
                raise
            raise eager from exc

    def call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` with dropouts seeded; a loss function's result is recorded.
        ``F.one_hot`` with a known class count keeps its range check at run time
        (``kernels.checks``): traced as is, an out-of-range class would give a zero row.
        An in-place composite that functionalize refuses runs as the op it stands for
        (``capture.inplace``), a custom op that writes its arguments as a functional call
        (``capture.mutable_ops``). CTC losses run with static shapes (``capture.ctc_loss``)."""
        func = INPLACE_REPLACEMENTS.get(func, func)
        if written := written_arguments(func):
            return call_functionally(func, written, args, kwargs, self.grads)
        if func is F.one_hot:
            if not _known_classes(args, kwargs):
                raise TraceError("OneHot num classes must be specified and must be constant. F.one_hot without "
                                 "num_classes: its output shape depends on the largest index (a tensor value), and "
                                 "every shape must be known when the program is compiled",
                                 where=user_source_line(), fix="pass num_classes, e.g. F.one_hot(labels, 10)")
            return checked_one_hot(*args, **kwargs)
        if func is F.scaled_dot_product_attention and self._mask_needs_grad(args, kwargs):
            return self._math_attention(args, kwargs)
        out = ctc_loss(func, args, kwargs) if func in CTC_FUNCTIONS else super().call(func, args, kwargs)
        if func in _LOSS_FUNCTIONS:
            self.losses.append(out)
            self.candidates.add(out, (args, kwargs))
        return out


    def _mask_needs_grad(self, args: tuple, kwargs: dict) -> bool:
        """An attention mask that needs a gradient (T5's learnt position bias is one)."""
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        return (self.grads is not None and self.grads.differentiated and isinstance(mask, torch.Tensor)
                and bool(self.grads.flags(mask) & REQUIRES))

    def _math_attention(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` as eager runs it when the mask needs a gradient: its
        math backend (the fused kernels have no gradient for the mask), dropout seeded as ever."""
        a = dict(zip(ATTENTION_ARGS, ATTENTION_DEFAULTS))
        a.update(zip(ATTENTION_ARGS, args))
        a.update(kwargs)
        if a["dropout_p"]:
            return super().call(F.scaled_dot_product_attention, args, kwargs)  # already the math, seeded
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            a["query"], a["key"], a["value"], a["attn_mask"], 0.0, a["is_causal"], scale=a["scale"],
            enable_gqa=a["enable_gqa"])
        return out


def _known_classes(args: tuple, kwargs: dict) -> bool:
    """Whether a ``F.one_hot`` call gives its class count (not -1: inferred from values)."""
    n = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    return isinstance(args[0] if args else kwargs.get("tensor"), torch.Tensor) and isinstance(n, int) and n >= 0


@contextlib.contextmanager
def capturing(mode: CaptureMode) -> Iterator[CaptureMode]:
    """Enter ``mode`` as this thread's active capture (see ``active_mode``); library code
    asking ``torch.compiler.is_compiling()`` meanwhile hears True (``capture.compiling``),
    a model's autograd.Functions keep their backward (``capture.custom_functions``),
    flex attention runs its dense math (``capture.flex_attention``), an ``assert`` on tensor
    values becomes a runtime check (``capture.runtime_checks``) and a transformer's causal-mask
    check on a mask of unknown values answers False (``capture.causal_masks``); ``torch._check``
    takes an ``int`` condition as its truth value (``capture.meta_checks``)."""
    _state.mode = mode
    try:
        with mode, compiling_state(), intercepting_functions(), flex_attention_as_math(), assert_statements(), \
                causal_mask_hints(), int_conditions():
            yield mode
    finally:
        _state.mode = None


def active_mode() -> CaptureMode | None:
    """The capture running in this thread (``capturing``), or None outside a trace."""
    mode: CaptureMode | None = getattr(_state, "mode", None)
    return mode


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark ``x`` as the loss to differentiate (PopTorch's ``identity_loss``).

    Args:
        x: the loss, or per-sample losses to reduce.
        reduction: ``"sum"``, ``"mean"`` or ``"none"`` (``x`` is already the loss); required,
            as in PopTorch 3.x. Another value raises ``OpArgumentError`` (a ValueError and,
            as upstream's assertion, an AssertionError).

    Eagerly (outside a traced model) it just returns the reduced ``x``.
    """
    if reduction not in ("sum", "mean", "none"):
        raise OpArgumentError(f"identity_loss: reduction must be 'sum', 'mean' or 'none', got {reduction!r}",
                         where=user_source_line(), fix="pass reduction='mean' (or 'sum' / 'none')")
    out = x.sum() if reduction == "sum" else x.mean() if reduction == "mean" else x
    mode = active_mode()
    if mode is not None:
        mode.marked.append(out)
        mode.candidates.add(out, x)
    return out


def find_loss(flat: list[torch.Tensor], mode: CaptureMode) -> tuple[int | None, int]:
    """The position of the loss among a forward's output leaves (see the module docstring),
    and how many final losses the outputs use (``capture.losses``: more than one is an error).

    The one final loss, when it is an output; failing that (no loss, or one the outputs only
    use: ``return out, loss * 2``), the single scalar float output. The position is None
    when there is no candidate, and ``-n`` when ``n`` outputs are equally likely candidates
    (ambiguous).
    """
    final = mode.candidates.final(flat)
    if len(final) == 1:
        loss = mode.candidates.tensors[final[0]]
        hits = [i for i, v in enumerate(flat) if v is loss]
        if hits:
            return _one_of(flat, hits), 1
    scalars = [i for i, v in enumerate(flat) if v.dim() == 0 and v.dtype.is_floating_point]
    return (_one_of(flat, scalars) if scalars else None), len(final)


def _one_of(flat: list[torch.Tensor], hits: list[int]) -> int:
    """The candidate among ``hits``: the one tensor they all are (a model may return its loss
    twice: LUKE's ``loss`` and ``mlm_loss``), else ``-len(hits)`` (ambiguous)."""
    return hits[0] if all(flat[i] is flat[hits[0]] for i in hits) else -len(hits)
