"""Operators made with ``torch.library.custom_op``, differentiated by their own formula.

Libraries written for ``torch.compile`` wrap their kernels as custom ops: a ``register_fake``
gives their shapes (a capture records the op as one node) and ``register_autograd`` their
gradient (``setup_context`` fills a ``ctx``, ``backward`` reads it). torch runs that formula
through an autograd.Function without ``setup_context``, which ``torch.func.vjp`` (the autodiff
pass traces a graph under it) refuses. ``route_custom_ops`` points such a node, in the
forward that autodiff traces, at ``custom_op_call``: where an input needs a gradient it
applies ``_FormulaVJP``, a Function with ``setup_context`` that calls the op below autograd
and the op's own ``setup_context`` and ``backward``, as eager's autograd does.

A custom op that writes an argument in place (``mutates_args``) cannot be functionalized
by ``torch.func.functionalize``; a capture calls ``ipuxl::functional_call`` for it instead
(``capture.mutable_ops``): the op on copies of the arguments it writes, whose new values it
returns with the op's results, as torch.compile's ``auto_functionalized`` does. No gradient
flows through it.

An op defined through ``torch.library.Library`` that got its formula from
``torch.library.register_autograd`` keeps that formula only inside torch's generated
Function, out of reach: autodiff names the op and says to define it with ``custom_op``
(``custom_op_error``).
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch._library import utils as library_utils
from torch._library.custom_ops import OPDEFS
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from ipuxl.errors import AutodiffError
from ipuxl.ir.context import traceback_source_line
from ipuxl.ir.meta import SOURCE

__all__ = ["route_custom_ops", "custom_op_call", "custom_op_error", "functional_call", "call_layout"]


def _definition(op: Any) -> Any:
    """The ``CustomOpDef`` behind ``op`` (an OpOverload of a ``custom_op``), else None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace in ("aten", "prims", "ipuxl"):
        return None
    return OPDEFS.get(f"{op.namespace}::{op._schema.name.split('::')[-1]}")


def route_custom_ops(gm: GraphModule) -> GraphModule:
    """Point ``gm``'s calls of custom ops at ``custom_op_call`` (in place; code regenerated
    only when a node changed)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and _definition(node.target) is not None:
            node.args = (node.target.name(), node.meta.get(SOURCE), *node.args)
            node.target, changed = custom_op_call, True
    if changed:
        gm.recompile()
    return gm


def custom_op_call(name: str, where: str | None, *args: Any, **kwargs: Any) -> Any:
    """The op ``name`` (``ns::op.overload``; ``where``: the user's line that called it): through
    ``_FormulaVJP`` where an input needs a gradient, else below autograd (where torch's
    generated Function does not apply)."""
    op = _overload(name)
    flat, spec = pytree.tree_flatten((args, kwargs))
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
        out = _FormulaVJP.apply(name, where, spec, *flat)
        return out[0] if _single_output(op) else out
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args, **kwargs)


def _overload(name: str) -> Any:
    namespace, _, rest = name.partition("::")
    opname, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), opname), overload or "default")


def _single_output(op: Any) -> bool:
    returns = op._schema.returns
    return len(returns) == 1 and not isinstance(returns[0].type, torch.ListType)


class _FormulaVJP(torch.autograd.Function):
    """A custom op whose gradient is its ``register_autograd`` formula."""

    @staticmethod
    def forward(name: str, where: str | None, spec: Any, *flat: Any) -> tuple[torch.Tensor, ...]:
        args, kwargs = pytree.tree_unflatten(list(flat), spec)
        with torch._C._AutoDispatchBelowAutograd():
            out = _overload(name)(*args, **kwargs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        name, where, spec, *flat = inputs
        op = _overload(name)
        args, kwargs = pytree.tree_unflatten(list(flat), spec)
        ctx.ipuxl_call = (name, where, args, len(flat), [(o.shape, o.dtype, o.device) for o in output])
        ctx.ipuxl_needs = tuple(_needs(a) for a in args)
        ctx.set_materialize_grads(False)  # no gradient reaches the outputs: no formula runs (below)
        setup = _definition(op)._setup_context_fn
        if setup is None:
            return
        args, kwargs = library_utils.fill_defaults(op._schema, args, kwargs)  # as torch's generated Function
        result = output[0] if _single_output(op) else tuple(output)
        if library_utils.has_kwarg_only_args(op._schema):
            setup(ctx=ctx, inputs=args, keyword_only_inputs=kwargs, output=result)
        else:
            setup(ctx=ctx, inputs=args, output=result)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        name, where, args, n_flat, specs = ctx.ipuxl_call
        if all(g is None for g in grads):
            # autograd reaches an op whose outputs no gradient reached (a traced forward of a
            # Function, whose gradient is its own backward): there is nothing to compute
            return (None,) * (3 + n_flat)
        backward = _definition(_overload(name))._backward_fn
        if backward is None:  # eager raises this at the backward: no formula was registered
            raise AutodiffError(f"a gradient must flow through the custom op {name}, which has no autograd formula",
                                where=where, fix=f"register one with torch.library.register_autograd("
                                                 f"'{name.split('.')[0]}', backward, setup_context=...)")
        full = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g  # eager materializes them
                for g, (shape, dtype, device) in zip(grads, specs)]
        real_needs = ctx.needs_input_grad
        try:
            ctx.needs_input_grad = ctx.ipuxl_needs  # what the formula sees in eager: one per argument
            result = backward(ctx, *full)
        except AutodiffError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's formula, traced on values not known
            raise AutodiffError(f"the backward formula of the custom op {name} failed while ipuxl traced it: "
                                f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}",
                                where=traceback_source_line(exc.__traceback__) or where,
                                fix="check the formula's arguments and results: eager PyTorch raises the same "
                                    "error for them") from exc
        finally:
            ctx.needs_input_grad = real_needs
        result = result if isinstance(result, tuple) else (result,)
        positional = sum(not a.kwarg_only for a in _overload(name)._schema.arguments)
        if len(result) not in (len(args), positional):  # eager's check: one per argument given, or per positional
            expected = f"{len(args)}" + ("" if positional == len(args) else f" or {positional}")
            raise AutodiffError(f"the backward formula of the custom op {name} returned {len(result)} gradients "
                                f"(expected {expected}: one per argument)", where=where,
                                fix="return one gradient per argument of the op, None where there is none")
        if any(g is not None for g in result[len(args):]):
            raise AutodiffError(f"the backward formula of the custom op {name} returned a gradient for an "
                                "argument that was not passed (left at its default)", where=where,
                                fix="return None for the arguments left at their defaults")
        grads_in = [g for arg, grad in zip(args, result) for g in _per_leaf(arg, grad)]
        return (None, None, None, *grads_in, *([None] * (n_flat - len(grads_in))))  # keyword-only: none


def _per_leaf(arg: Any, grad: Any) -> list[Any]:
    """``grad`` of argument ``arg`` spread over ``arg``'s pytree leaves (as it was flattened)."""
    n = len(pytree.tree_leaves(arg))
    if isinstance(arg, (list, tuple)):
        return [None] * n if grad is None else list(grad)
    return [grad] * n  # one leaf (a tensor or a scalar), or none (None)


def _needs(arg: Any) -> bool | list[bool]:
    """``ctx.needs_input_grad``'s entry for an argument, as eager's: a list's is one per element."""
    if isinstance(arg, (list, tuple)):
        return [isinstance(t, torch.Tensor) and t.requires_grad for t in arg]
    return isinstance(arg, torch.Tensor) and arg.requires_grad


def custom_op_error(exc: BaseException, where: Callable[[Any], str | None]) -> AutodiffError | None:
    """For torch's refusal of a custom op's generated Function under ``torch.func``: which op
    (``where(op)``: the user's line that called it), and what to do; None for another error."""
    if "must override the setup_context" not in str(exc):
        return None
    tb: types.TracebackType | None = exc.__traceback__
    op = None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "autograd_impl" and "op" in tb.tb_frame.f_locals:
            op = tb.tb_frame.f_locals["op"]  # the op whose autograd kernel torch generated
        tb = tb.tb_next
    if op is None:
        return None
    return AutodiffError(
        f"cannot differentiate the custom op {op.name()}: its autograd formula was registered with "
        "torch.library.register_autograd on an op defined through torch.library.Library, and torch keeps such a "
        "formula where ipuxl cannot read it", where=where(op),
        fix="define the op with @torch.library.custom_op (its register_autograd formula is then used), or call it "
            "inside a torch.autograd.Function whose backward gives the gradient")


# -- custom ops that write their arguments ------------------------------------------------------
_lib = torch.library.Library("ipuxl", "FRAGMENT")
_lib.define("functional_call(str op, int layout, Tensor[] tensors) -> Tensor[]")
_LAYOUTS: list[tuple[Any, tuple[Any, ...], tuple[int, ...]]] = []
_LAYOUT_KEYS: dict[str, int] = {}  # one layout per distinct call: a program that recompiles adds none


def call_layout(spec: Any, leaves: list[Any], written: list[int]) -> int:
    """The key of an op call's layout: its arguments' pytree ``spec``, their non-tensor
    ``leaves`` (a tensor's position holds None), and which tensors (by position among them) it writes."""
    layout = (spec, tuple(None if isinstance(v, torch.Tensor) else v for v in leaves), tuple(written))
    text = repr(layout)
    if text not in _LAYOUT_KEYS:
        _LAYOUT_KEYS[text] = len(_LAYOUTS)
        _LAYOUTS.append(layout)
    return _LAYOUT_KEYS[text]


def functional_call(op: str, layout: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The op on copies of the tensors it writes: their new values, then its tensor results."""
    spec, constants, written = _LAYOUTS[layout]
    copies = {i: tensors[i].clone() for i in written}
    given = iter(copies.get(i, t) for i, t in enumerate(tensors))
    args, kwargs = pytree.tree_unflatten([next(given) if v is None else v for v in constants], spec)
    with torch._C._AutoDispatchBelowAutograd():
        out = _overload(op)(*args, **kwargs)
    results = [] if out is None else list(out) if isinstance(out, (tuple, list)) else [out]
    return [copies[i] for i in written] + results


def _no_gradient(keyset: Any, op: str, layout: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Under autograd: the call's results carry no gradient (``capture.mutable_ops`` refuses the
    calls where one would be needed)."""
    below = keyset
    for key in (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA):
        below = below.remove(key)
    return torch.ops.ipuxl.functional_call.default.redispatch(below, op, layout, tensors)


_lib.impl("functional_call", functional_call, "CompositeExplicitAutograd")
_lib.impl("functional_call", _no_gradient, "Autograd", with_keyset=True)
torch.library.register_fake("ipuxl::functional_call", functional_call, lib=_lib)
