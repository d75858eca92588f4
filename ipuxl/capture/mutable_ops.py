"""Custom ops that write their arguments in place, captured as a functional call.

``torch.func.functionalize`` refuses an operator outside aten whose schema writes an
argument (``torch.library.custom_op(..., mutates_args={"buf"})``: "Found a custom (non-ATen)
operator whose output has alias annotations"). While a module is captured, such a call runs as
``ipuxl::functional_call`` (``kernels.custom_ops``), which returns the new values of the
arguments the op writes, and each of those arguments is then updated with ``copy_``: the
functional form that torch.compile's ``auto_functionalized`` gives the same call. A buffer the
op writes is updated on the device, as an in-place aten op's would be.

The ``out=`` form of some of torch's composite functions (``torch.matmul(a, b, out=t)``) is
refused in the same words; ``call_out_variant`` runs it as the function without ``out`` and a
``copy_`` of the result into ``out`` (which is also returned), as eager writes it.

Such an op has no autograd formula (``register_autograd`` refuses one), and eager autograd
knows nothing of its writes. A capture refuses the calls where that would matter: one that
writes a tensor that needs a gradient, or returns results while an input needs one.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ipuxl.capture.grad_mode import REQUIRES, GradTracker
from ipuxl.errors import TraceError
from ipuxl.ir.context import user_source_line
from ipuxl.kernels.custom_ops import call_layout

__all__ = ["written_arguments", "call_functionally", "refused_out_variant", "call_out_variant"]

_BUILT_IN = ("aten", "prims", "ipuxl")


def _overload(func: Callable) -> Any:
    """``func`` as an OpOverload outside aten (a packet with one overload is that one), else None."""
    op: Any = func
    if isinstance(op, torch._ops.OpOverloadPacket):
        overloads = op.overloads()
        op = getattr(op, overloads[0]) if len(overloads) == 1 else None
    if not isinstance(op, torch._ops.OpOverload) or op.namespace in _BUILT_IN:
        return None
    return op


def written_arguments(func: Callable) -> list[str]:
    """The names of the arguments that ``func`` writes, when it is an op outside aten (an
    OpOverload, or a packet with one overload) whose schema writes some; else none."""
    op = _overload(func)
    if op is None:
        return []
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def call_functionally(func: Callable, written: list[str], args: tuple, kwargs: dict,
                      grads: GradTracker | None) -> Any:
    """``func(*args, **kwargs)`` as ``ipuxl::functional_call`` and ``copy_`` into what it writes."""
    op = _overload(func)
    schema = op._schema
    bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name))
             for i, a in enumerate(schema.arguments)}
    targets = [t for name in written for t in pytree.tree_leaves(bound[name]) if isinstance(t, torch.Tensor)]
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    _refuse_gradients(op, written, targets, tensors, grads)
    positions = [next(i for i, t in enumerate(tensors) if t is target) for target in targets]
    new = torch.ops.ipuxl.functional_call(op.name(), call_layout(spec, leaves, positions), tensors)
    for target, value in zip(targets, new):
        target.copy_(value)
    results = new[len(targets):]
    returns = schema.returns
    if not returns:
        return None
    if len(returns) == 1:
        return list(results) if isinstance(returns[0].type, torch.ListType) else results[0]
    return tuple(results)


def _refuse_gradients(op: Any, written: list[str], targets: list[torch.Tensor], tensors: list[torch.Tensor],
                      grads: GradTracker | None) -> None:
    if grads is None or not grads.differentiated:
        return
    needs = [t for t in tensors if grads.flags(t) & REQUIRES]
    if any(t is n for t in targets for n in needs):
        problem = f"writes its argument {', '.join(repr(w) for w in written)} in place, and that tensor needs a gradient"
    elif needs and op._schema.returns:
        problem = "returns results computed from a tensor that needs a gradient"
    else:
        return
    raise TraceError(f"the custom op {op.name()} {problem}: an op that writes its arguments has no autograd formula "
                     "(torch.library.register_autograd refuses one), so no gradient can flow through it",
                     where=user_source_line(),
                     fix="write only into tensors that need no gradient (buffers), or make the op functional "
                         "(mutates_args=(), returning new tensors) and give it a formula with register_autograd")


_ALIAS_REFUSAL = "whose output has alias annotations"


def refused_out_variant(kwargs: dict, failure: Exception) -> bool:
    """Whether ``failure`` is functionalize's refusal of a call given one tensor as ``out=``."""
    return isinstance(kwargs.get("out"), torch.Tensor) and _ALIAS_REFUSAL in str(failure)


def call_out_variant(call: Callable[[Callable, tuple, dict], Any], func: Callable, args: tuple, kwargs: dict,
                     grads: GradTracker | None, failure: Exception) -> torch.Tensor:
    """``func(*args, out=out)`` as ``out.copy_(func(*args))``, returning ``out`` (``call`` runs
    ``func``); eager's error when an argument requires grad, and ``failure`` again when the
    result's shape or dtype is not ``out``'s (eager would resize or refuse)."""
    out: torch.Tensor = kwargs["out"]
    rest = {k: v for k, v in kwargs.items() if k != "out"}
    tensors = [v for v in pytree.tree_leaves((args, rest)) if isinstance(v, torch.Tensor)]
    requires = any(bool(grads.flags(t) & REQUIRES) if grads is not None else t.requires_grad for t in tensors)
    if requires and torch.is_grad_enabled():
        name = getattr(func, "__name__", str(func))
        raise RuntimeError(f"{name}(): functions with out=... arguments don't support automatic differentiation, "
                           "but one of the arguments requires grad.")
    result = call(func, args, rest)
    if not isinstance(result, torch.Tensor) or result.shape != out.shape or result.dtype != out.dtype:
        raise failure
    out.copy_(result)
    return out
