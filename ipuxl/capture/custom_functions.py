"""A user's ``torch.autograd.Function`` in a captured module: its forward's ops are traced, and
its gradient is its own ``backward``, as eager runs it.

torch's functional transforms, which a capture runs under, refuse old-style Functions
(``forward(ctx, ...)``) and cannot functionalize new-style ones (``setup_context``). While a
module is captured (``intercepting_functions``), ``Function.apply`` of a Function defined
outside torch and ipuxl instead:

1. runs the forward, so that its ops are traced like the module's own: an old-style one with
   a recording ``ctx``, a new-style one and then its ``setup_context`` on that ``ctx``;
2. keeps what the backward needs in a ``_Record`` under a key: the class, the ``ctx``'s
   attributes (tensors in them, and those given to ``save_for_backward``, become the node's
   saved inputs), ``needs_input_grad``, ``set_materialize_grads``, non-differentiable outputs;
3. passes the forward's tensor outputs through one ``ipuxl::custom_function(key, inputs,
   outputs, saved)`` node, which returns them (copies).

Differentiated (autodiff traces the graph under ``torch.func.vjp``), that node's Autograd
kernel applies ``_CustomVJP``, whose backward calls the Function's ``backward`` on a ``ctx``
rebuilt from the record and the saved tensors: the Function's inputs get its gradient, and the
forward's traced ops none (the outputs and saved values enter the node without one), as in
eager. ``mark_dirty`` (an in-place forward) is refused.

torch's reentrant ``checkpoint`` (``CheckpointFunction``, whose backward recomputes the
forward and runs the autograd engine itself) runs inline, as the non-reentrant form is
captured: the values and gradients of eager's recomputation (with ``preserve_rng_state``,
eager's default; ipuxl's random draws are its own in either case), and no gradient inside it
when no tensor argument requires grad, as eagerly.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointFunction

from ipuxl.capture.failures import DATA_DEPENDENT
from ipuxl.errors import AutodiffError, IpuxlError, TraceError
from ipuxl.ir.context import traceback_source_line
from ipuxl.source import user_source_line

__all__ = ["intercepting_functions", "route_custom_functions", "custom_function_call"]

_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
# torch's own Functions whose backward is the derivative of their forward's ops: a capture runs
# their forward (flex attention's ``ModIndex``: ``bias[h]`` in a score_mod is ``aten.index``, and
# its backward the scatter that is aten.index's own derivative)
_INLINED = {("torch._dynamo._trace_wrapped_higher_order_op", "ModIndex")}
_OWN_MODULES = ("torch.", "ipuxl.")
_NO_SETUP_CONTEXT = torch.autograd.Function.setup_context  # what an old-style Function inherits
_capturing = threading.local()  # .depth: the captures this thread is inside


@dataclass
class _Saved:
    """Where a tensor of the forward's ``ctx`` is in the node's saved inputs."""
    index: int


@dataclass
class _Record:
    cls: type
    needs_input_grad: tuple[bool, ...]
    tensor_inputs: list[int]  # positions of the tensor arguments among apply's arguments
    tensor_outputs: list[int]  # positions of the tensor outputs among the forward's outputs
    n_outputs: int
    output_specs: list[tuple[torch.Size, torch.dtype]]  # of the tensor outputs (materialized grads)
    save_layout: list[int | None]  # save_for_backward's tensors: saved index, or None for a None
    attributes: dict[str, Any] = field(default_factory=dict)  # tensors replaced by _Saved
    materialize: bool = True

    def backward(self, saved: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]
                 ) -> list[torch.Tensor | None]:
        """The Function's gradients of its tensor inputs, for ``grads`` of its tensor outputs."""
        device = next((t.device for t in (*saved, *grads) if t is not None), None)
        full: list[torch.Tensor | None] = [None] * self.n_outputs
        for pos, grad, (shape, dtype) in zip(self.tensor_outputs, grads, self.output_specs):
            if grad is None and self.materialize:
                grad = torch.zeros(shape, dtype=dtype, device=device)
            full[pos] = grad
        ctx = _BackwardContext(self, saved)
        try:
            result = self.cls.backward(ctx, *full)  # type: ignore[attr-defined]
        except IpuxlError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's backward, traced on values not known
            raise _backward_error(self.cls, exc) from exc
        result = result if isinstance(result, tuple) else (result,)
        return [result[i] if i < len(result) else None for i in self.tensor_inputs]


def _backward_error(cls: type, exc: Exception) -> AutodiffError:
    message = (str(exc).strip().splitlines() or [""])[0]
    unknown = any(k in f"{type(exc).__name__} {message}" for k in DATA_DEPENDENT)
    return AutodiffError(
        f"the backward of the custom autograd.Function {cls.__module__}.{cls.__qualname__} failed while ipuxl "
        f"traced it: {type(exc).__name__}: {message}", where=traceback_source_line(exc.__traceback__),
        fix=("tensor values are not known while the backward is traced: replace Python control flow on them "
             "(if, assert, .item()) by tensor ops (torch.where, masks)" if unknown else
             "check the backward's arguments and results: eager PyTorch raises the same error for them"))


# Records live as long as a graph holds their node: a capture's are pending (per thread, until the
# next capture starts) until ``route_custom_functions`` puts each in its node's meta; then they are
# found by key while any graph (the trace, the IR, a lowered copy) holds that node.
_ROUTED: weakref.WeakValueDictionary[int, _Record] = weakref.WeakValueDictionary()
RECORD = "ipuxl_custom_function"
_KEYS = itertools.count()


def _pending() -> dict[int, _Record]:
    pending: dict[int, _Record] = _capturing.__dict__.setdefault("records", {})
    return pending


def _record(key: int) -> _Record:
    return _ROUTED[key] if key in _ROUTED else _pending()[key]


class _RecordingContext:
    """The ``ctx`` a Function's forward (or ``setup_context``) writes during a capture."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self._to_save: tuple[Any, ...] = ()
        self._non_differentiable: tuple[Any, ...] = ()
        self._dirty: tuple[Any, ...] = ()
        self._materialize = True

    def save_for_backward(self, *tensors: Any) -> None:
        for i, t in enumerate(tensors):
            if t is not None and not isinstance(t, torch.Tensor):  # eager's check and message
                raise TypeError(f"save_for_backward can only save variables, but argument {i} is of type "
                                f"{type(t).__name__}")
        self._to_save = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        pass  # forward-mode AD: not run by a capture

    def mark_non_differentiable(self, *outputs: Any) -> None:
        self._non_differentiable = outputs

    def mark_dirty(self, *tensors: Any) -> None:
        self._dirty = tensors

    def set_materialize_grads(self, value: bool) -> None:
        self._materialize = bool(value)

    def user_attributes(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and k != "needs_input_grad"}


class _BackwardContext:
    """The ``ctx`` the Function's backward reads: the forward's attributes and saved tensors."""

    def __init__(self, record: _Record, saved: tuple[torch.Tensor, ...]):
        for name, value in record.attributes.items():
            setattr(self, name, pytree.tree_map(lambda v: saved[v.index] if isinstance(v, _Saved) else v, value))
        self.needs_input_grad = record.needs_input_grad
        self.saved_tensors = tuple(None if i is None else saved[i] for i in record.save_layout)
        self.saved_variables = self.saved_tensors
        self.materialize_grads = record.materialize


def _captured_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    if cls is CheckpointFunction and not kwargs and getattr(_capturing, "depth", 0) > 0:
        return _reentrant_checkpoint(*args)
    if (cls.__module__, cls.__qualname__) in _INLINED and getattr(_capturing, "depth", 0) > 0:
        return cls.forward(*args, **kwargs)  # type: ignore[attr-defined]
    if (kwargs or not getattr(_capturing, "depth", 0) or cls.__module__.startswith(_OWN_MODULES)
            or cls.__module__ in ("torch", "ipuxl")):
        return _ORIGINAL_APPLY.__get__(None, cls)(*args, **kwargs)
    needs = tuple(isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()) for a in args)
    ctx = _RecordingContext(needs)
    if cls.setup_context is not _NO_SETUP_CONTEXT:  # type: ignore[attr-defined]  # new style
        output = cls.forward(*args)  # type: ignore[attr-defined]
        cls.setup_context(ctx, args, output)  # type: ignore[attr-defined]
    else:
        output = cls.forward(ctx, *args)  # type: ignore[attr-defined]
    if ctx._dirty:
        raise TraceError(f"the custom autograd.Function {cls.__module__}.{cls.__qualname__} modifies its input in "
                         "place (ctx.mark_dirty): a capture cannot keep that", where=user_source_line(),
                         fix="return a new tensor from its forward instead of writing into an input")
    outputs = output if isinstance(output, tuple) else (output,)
    tensor_outputs = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor)]
    if not any(needs) or not tensor_outputs:
        return output  # nothing to differentiate: the traced forward is all
    saved: list[torch.Tensor] = []

    def stash(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            saved.append(value)
            return _Saved(len(saved) - 1)
        return value

    save_layout = [None if t is None else stash(t).index for t in ctx._to_save]
    attributes = {k: pytree.tree_map(stash, v) for k, v in ctx.user_attributes().items()}
    non_differentiable = {id(t) for t in ctx._non_differentiable}
    key = next(_KEYS)
    _pending()[key] = _Record(
        cls, needs, [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)], tensor_outputs, len(outputs),
        [(outputs[i].shape, outputs[i].dtype) for i in tensor_outputs], save_layout, attributes, ctx._materialize)
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    passed = torch.ops.ipuxl.custom_function(key, inputs, [outputs[i] for i in tensor_outputs], saved)
    result = list(outputs)
    for pos, value in zip(tensor_outputs, passed):
        result[pos] = outputs[pos].detach() if id(outputs[pos]) in non_differentiable else value
    return tuple(result) if isinstance(output, tuple) else result[0]


def _reentrant_checkpoint(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
    """``checkpoint(function, *args, use_reentrant=True)``, run inline: the values and gradients
    of eager's recomputation. As eagerly, when no tensor argument requires grad it warns, and
    nothing inside gets a gradient (eager's outputs then do not require grad)."""
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):  # the capture's eager answer
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None", stacklevel=4)
        with torch.no_grad():
            return function(*args)
    return function(*args)


@contextlib.contextmanager
def intercepting_functions() -> Iterator[None]:
    """``Function.apply`` of user Functions records them as above while inside."""
    _capturing.depth = getattr(_capturing, "depth", 0) + 1
    if _capturing.depth == 1:
        _pending().clear()  # an earlier capture's unrouted records (it failed) go
    torch.autograd.Function.apply = classmethod(_captured_apply)  # other threads' calls pass through
    try:
        yield
    finally:
        _capturing.depth -= 1
        if not _capturing.depth:
            torch.autograd.Function.apply = _ORIGINAL_APPLY


# -- the node and its gradient -----------------------------------------------------------------
_lib = torch.library.Library("ipuxl", "FRAGMENT")
_lib.define("custom_function(int key, Tensor[] inputs, Tensor[] outputs, Tensor[] saved) -> Tensor[]")


def _passed(key: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
            saved: list[torch.Tensor]) -> list[torch.Tensor]:
    return [o.clone() for o in outputs]


def _fake(key: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
          saved: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(o) for o in outputs]


def custom_function_call(key: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                         saved: list[torch.Tensor]) -> list[torch.Tensor]:
    """The node's target once traced (``route_custom_functions``): ``_CustomVJP`` where its
    inputs need a gradient (autodiff's trace under ``torch.func.vjp``, which handles a
    Function applied here, in Python), else the op."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return list(_CustomVJP.apply(key, len(inputs), len(outputs), *inputs, *outputs, *saved))
    return torch.ops.ipuxl.custom_function(key, inputs, outputs, saved)


def route_custom_functions(gm: torch.fx.GraphModule) -> None:
    """Point a trace's ``ipuxl::custom_function`` nodes at ``custom_function_call`` (in place),
    each holding its record in its meta (``RECORD``)."""
    found = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.ipuxl.custom_function.default:
            key = node.args[0]
            node.meta[RECORD] = _ROUTED[key] = _pending().pop(key) if key in _pending() else _record(key)
            node.target, found = custom_function_call, True
    if found:
        gm.recompile()


class _CustomVJP(torch.autograd.Function):
    """The node differentiated: the outputs pass through, the gradient is the record's."""

    @staticmethod
    def forward(key: int, n_inputs: int, n_outputs: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(o.clone() for o in tensors[n_inputs:n_inputs + n_outputs])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        key, n_inputs, n_outputs, *tensors = inputs
        ctx.key, ctx.n_inputs, ctx.n_others = key, n_inputs, len(tensors) - n_inputs
        ctx.save_for_backward(*tensors[n_inputs + n_outputs:])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        input_grads = _record(ctx.key).backward(ctx.saved_tensors, grads)
        return (None, None, None, *input_grads, *([None] * ctx.n_others))


_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA)


def _unrouted(keyset: Any, key: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
              saved: list[torch.Tensor]) -> Any:
    """The op under autograd: its gradient is ``custom_function_call``'s, never none."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        raise AutodiffError(f"internal: the custom autograd.Function {_record(key).cls.__qualname__} was "
                            "differentiated as an op without its backward (route_custom_functions)")
    below = keyset
    for k in _AUTOGRAD_KEYS:
        below = below.remove(k)
    return torch.ops.ipuxl.custom_function.default.redispatch(below, key, inputs, outputs, saved)


_lib.impl("custom_function", _passed, "CompositeExplicitAutograd")
_lib.impl("custom_function", _unrouted, "Autograd", with_keyset=True)
torch.library.register_fake("ipuxl::custom_function", _fake, lib=_lib)
