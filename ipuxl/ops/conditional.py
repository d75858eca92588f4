"""PopXL's ``conditional``: run ``then_branch`` or ``else_branch`` as ``cond`` says at run time.

How ipuxl runs it: the two branches are called from one *select graph*
``(cond, then inputs..., else inputs...) -> where(cond, then outputs, else outputs)``
(built once per pair of branches), which the parent calls like any graph. Both branches
are computed and the outputs of the one ``cond`` picks are kept; values and gradients
(``transforms.autodiff`` differentiates the select graph) are PopXL's: each branch's
float inputs pass a gate whose gradient is selected, not multiplied, so a NaN or inf
in the gradient of the branch not taken (``sqrt`` of a negative input, say) never
reaches the inputs.

Inputs a branch takes by reference (``TensorByRef``) are changed only by the branch
taken: each branch writes a copy, then each by-reference input takes its branch's
copy where that branch is taken and its own current value elsewhere. The write-backs
run in order, each reading the tensor after the previous one wrote it, so one tensor
passed by reference to both branches ends with exactly the taken branch's writes. Collectives in a branch run on
every replica whichever branch it takes (their values are kept only where taken).

Host transfers in a branch are PopXL's: only the branch taken takes (``host_load``) or
gives (``host_store``) slices of the run's streams. The select graph's two calls carry
an ``IO_GATE`` record, and the device hands the branch not taken blank stream cursors
(``kernels.host_io.gate_cursors``): its loads read zeros, its stores go nowhere, and
its outputs are discarded as above. A stream used in one branch (or more often in one
than the other) therefore takes fewer slices in runs where that branch is not taken;
the session checks the busier branch's count against ``num_host_transfers``, and the
slices of a stored stream that no executed store filled are zeros.

Differs from PopXL: since both branches are computed, a branch must not print or
write Streaming Memory (``remote_store``), which would happen for the branch not taken
too: those are refused with an ``InvalidValueError`` (a ValueError). The loads of the
branch not taken see zeros, so an op that fails on zeros (integer division by a loaded
value) fails even when its branch is not taken.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Mapping

import torch

from ipuxl.errors import CallIndexError, CallInputError, InvalidValueError
from ipuxl.ir import context
from ipuxl.ir.context import in_sequence
from ipuxl.ir.calls import call_nodes, reachable_from
from ipuxl.ir.graph import Graph
from ipuxl.ir.meta import BY_REF, IO_GATE, OP, SOURCE
from ipuxl.ir.tensor import Tensor, TensorByRef, TensorSpec
from ipuxl.ops.call import CallSiteInfo, call, call_with_info
from ipuxl.ops.elementwise import where
from ipuxl.ops.shape import detach, identity, reshape
from ipuxl.ops.var_updates import copy_var_update_

__all__ = ["conditional", "conditional_with_info", "ConditionalSiteInfo"]

_SIDE_EFFECT_OPS = {"print_tensor": "print_tensor", "remote_store": "a Streaming Memory write (remote_store)"}
_SELECT_GRAPHS: "weakref.WeakKeyDictionary[Graph, dict[tuple[int, tuple[int, ...]], Graph]]" = (
    weakref.WeakKeyDictionary())  # then branch -> (id(else branch), cond shape) -> select graph


class ConditionalSiteInfo:
    """The call site of a ``conditional``: parent tensors <-> tensors of the two branches.

    Parent inputs are ``(cond, then inputs..., else inputs...)``, as in PopXL's IfOp.
    """

    def __init__(self, site: CallSiteInfo, then_branch: Graph, else_branch: Graph):
        self._site, self._then, self._else = site, then_branch, else_branch

    @property
    def called_graph(self) -> tuple[Graph, Graph]:
        """``(then_branch, else_branch)``."""
        return self._then, self._else

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return self._site.inputs

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return self._site.outputs[:len(self._then.outputs)]

    def _branch(self, then_branch: bool) -> Graph:
        return self._then if then_branch else self._else

    def _offset(self, then_branch: bool) -> int:
        return 1 if then_branch else 1 + len(self._then.inputs)

    def graph_to_parent_input_index(self, idx: int, then_branch: bool = True) -> int:
        """The parent input index of input ``idx`` of the then (else) branch."""
        _check_index(idx, len(self._branch(then_branch).inputs), "graph input")
        return self._offset(then_branch) + idx

    def parent_to_graph_input_index(self, idx: int) -> int:
        """The branch input index of parent input ``idx`` (the condition, index 0, has none)."""
        _check_index(idx, len(self.inputs), "parent input", low=1)
        return idx - self._offset(self.is_parent_index_in_then_branch(idx))

    def is_parent_index_in_then_branch(self, idx: int) -> bool:
        """True when parent input ``idx`` feeds the then branch, False for the else branch."""
        _check_index(idx, len(self.inputs), "parent input", low=1)
        return idx < 1 + len(self._then.inputs)

    def graph_to_parent_output_index(self, idx: int, then_branch: bool = True) -> int:
        return _check_index(idx, len(self._branch(then_branch).outputs), "graph output")

    def parent_to_graph_output_index(self, idx: int, then_branch: bool = True) -> int:
        return _check_index(idx, len(self.outputs), "parent output")

    def graph_to_parent(self, graph_tensor: Tensor) -> Tensor:
        """The parent tensor connected to an input or output of either branch."""
        for then_branch in (True, False):
            branch = self._branch(then_branch)
            for i, t in enumerate(branch.inputs):
                if t is graph_tensor:
                    return self.inputs[self._offset(then_branch) + i]
            for i, t in enumerate(branch.outputs):
                if t is graph_tensor:
                    return self.outputs[i]
        raise CallInputError(f"tensor '{graph_tensor.name}' is not an input or output of the called graph(s)",
                             where=context.user_source_line(), fix="pass a tensor of then_branch or else_branch")

    def parent_to_graph(self, parent_tensor: Tensor) -> Tensor:
        """The branch input the parent tensor feeds (the first if several)."""
        for idx, t in enumerate(self.inputs[1:], start=1):
            if t is parent_tensor:
                then_branch = self.is_parent_index_in_then_branch(idx)
                return self._branch(then_branch).inputs[idx - self._offset(then_branch)]
        raise CallInputError(f"tensor '{parent_tensor.name}' is not a parent graph input of the call site",
                             where=context.user_source_line(), fix="pass one of the branch inputs of this site")

    def set_parent_input_modified(self, parent_tensor: Tensor, infer_modified_regions: bool = True) -> None:
        raise NotImplementedError("Parent input modification is not implemented for the conditional op "
                                  "(nor in PopXL)")


def _check_index(idx: int, count: int, kind: str, low: int = 0) -> int:
    if not low <= idx < count:
        raise CallIndexError(f"{kind} index {idx} is out of range [{low}, {count})", where=context.user_source_line(),
                             fix=f"use an index in [{low}, {count})")
    return idx


def conditional(cond: Tensor, then_branch: Graph, else_branch: Graph,
                then_inputs: Iterable[Any] | None = None, else_inputs: Iterable[Any] | None = None,
                then_inputs_dict: Mapping[Tensor, Any] | None = None,
                else_inputs_dict: Mapping[Tensor, Any] | None = None) -> tuple[Tensor, ...]:
    """The outputs of ``then_branch`` where the boolean scalar ``cond`` is true, else of
    ``else_branch``; inputs are given per branch as in ``ops.call`` (see the module note)."""
    return conditional_with_info(cond, then_branch, else_branch, then_inputs, else_inputs, then_inputs_dict,
                                 else_inputs_dict).outputs


def conditional_with_info(cond: Tensor, then_branch: Graph, else_branch: Graph,
                          then_inputs: Iterable[Any] | None = None, else_inputs: Iterable[Any] | None = None,
                          then_inputs_dict: Mapping[Tensor, Any] | None = None,
                          else_inputs_dict: Mapping[Tensor, Any] | None = None,
                          check_inputs: bool = True) -> ConditionalSiteInfo:
    """``conditional`` returning its ``ConditionalSiteInfo``.

    Raises:
        InvalidValueError (a ValueError): ``cond`` is not a one-element bool tensor, the
            branches' outputs differ in number, shape or dtype, or a branch has an effect
            beyond its outputs.
        CallInputError (a ValueError): inputs missing, unknown or given twice (as ``ops.call``).
    """
    _check_condition(cond)
    _check_outputs(then_branch, else_branch)
    for branch in (then_branch, else_branch):
        _check_side_effects(branch)
    select = _select_graph(then_branch, else_branch, cond.spec)
    inputs: dict[Tensor, Any] = {select.inputs[0]: cond}
    inputs.update(_bind(select, 1, then_branch, then_inputs, then_inputs_dict))
    inputs.update(_bind(select, 1 + len(then_branch.inputs), else_branch, else_inputs, else_inputs_dict))
    return ConditionalSiteInfo(call_with_info(select, inputs_dict=inputs), then_branch, else_branch)


def _check_condition(cond: Tensor) -> None:
    if not isinstance(cond, Tensor) or cond.nelms != 1 or cond.spec.dtype != torch.bool:
        raise InvalidValueError(f"conditional: cond must be a boolean single-value tensor, got {cond!r}",
                                where=context.user_source_line(),
                                fix="compare to get a bool, e.g. ops.greater(x, 0), and reduce it to one element")


def _check_outputs(then_branch: Graph, else_branch: Graph) -> None:
    then_specs = [(t.shape, t.spec.dtype) for t in then_branch.outputs]
    else_specs = [(t.shape, t.spec.dtype) for t in else_branch.outputs]
    if len(then_specs) != len(else_specs):
        problem = f"must have the same number of outputs: {len(then_specs)} != {len(else_specs)}"
    elif then_specs != else_specs:
        problem = f"must have outputs of the same shapes and dtypes: {then_specs} != {else_specs}"
    else:
        return
    raise InvalidValueError(f"`then_branch` graph '{then_branch.name}' and `else_branch` graph "
                            f"'{else_branch.name}' {problem}", where=context.user_source_line(),
                            fix="return tensors of matching shapes and dtypes from both branches")


def _check_side_effects(branch: Graph) -> None:
    for graph in reachable_from([branch]):
        for node in graph.fx.nodes:
            effect = _SIDE_EFFECT_OPS.get(node.meta.get(OP, ""))
            if effect:
                raise InvalidValueError(
                    f"conditional: branch '{branch.name}' contains {effect} (in graph '{graph.name}'); ipuxl "
                    "computes both branches and keeps one's results, so a branch may not print or write "
                    "Streaming Memory (host transfers are fine: only the branch taken does them)",
                    where=node.meta.get(SOURCE) or context.user_source_line(),
                    fix="move prints and remote stores out of the branches: apply them to the conditional's "
                        "outputs")


def _select_graph(then_branch: Graph, else_branch: Graph, cond_spec: TensorSpec) -> Graph:
    """The graph calling both branches and selecting their outputs (one per branch pair)."""
    cache = _SELECT_GRAPHS.setdefault(then_branch, {})
    key = (id(else_branch), cond_spec.shape)  # the Ir keeps its graphs alive: ids stay unique
    if key not in cache:
        n_then = len(then_branch.inputs)

        writes = any(_by_ref(t) for t in (*then_branch.inputs, *else_branch.inputs))

        def conditional_select(cond: Tensor, *xs: Tensor) -> tuple[Tensor, ...]:
            # With by-reference inputs, in program order: the copies before any write-back, and each
            # write-back's read after the previous write (a tensor given to both branches by reference).
            with in_sequence() if writes else contextlib.nullcontext():
                flag = reshape(cond, ()) if cond.shape != () else cond
                then_args = _branch_args(flag, then_branch, xs[:n_then], True)
                else_args = _branch_args(flag, else_branch, xs[n_then:], False)
                outs_then = _gated_call(then_branch, then_args, True)
                outs_else = _gated_call(else_branch, else_args, False)
                _write_back(flag, then_branch, xs[:n_then], then_args, True)
                _write_back(flag, else_branch, xs[n_then:], else_args, False)
                return tuple(where(flag, a, b) for a, b in zip(outs_then, outs_else))

        specs = [TensorByRef(t.spec) if _by_ref(t) else t.spec for t in (*then_branch.inputs, *else_branch.inputs)]
        cache[key] = then_branch.ir.create_graph(conditional_select, cond_spec, *specs)
    return cache[key]


def _gated_call(branch: Graph, args: list[Tensor], taken_when: bool) -> tuple[Tensor, ...]:
    """Call ``branch`` from the select graph; its host transfers happen only when the
    condition (the select graph's input 0) is ``taken_when`` (``IO_GATE``, see the module note)."""
    outputs = call(branch, *args)
    site = list(call_nodes(context.gcg()))[-1]
    site.meta[IO_GATE] = (0, taken_when)
    return outputs


def _by_ref(t: Tensor) -> bool:
    return bool(t.node.meta.get(BY_REF))


def _branch_args(flag: Tensor, branch: Graph, xs: tuple[Tensor, ...], taken_when: bool) -> list[Tensor]:
    """What the select graph passes to ``branch``: a copy of each by-reference input (the
    branch writes the copy), each other input through the gradient gate."""
    return [identity(x) if _by_ref(t) else _gate(flag, x, taken_when) for t, x in zip(branch.inputs, xs)]


def _write_back(flag: Tensor, branch: Graph, xs: tuple[Tensor, ...], args: list[Tensor], taken_when: bool) -> None:
    """Give each by-reference input of ``branch`` the branch's copy where the branch is taken."""
    for t, x, written in zip(branch.inputs, xs, args):
        if _by_ref(t):
            copy_var_update_(x, where(flag, written, x) if taken_when else where(flag, x, written))


def _gate(flag: Tensor, x: Tensor, taken_when: bool) -> Tensor:
    """``x`` itself, whose gradient is zero unless ``flag == taken_when``: ``where`` selects
    (never multiplies), so a NaN or inf gradient from the branch not taken cannot leak."""
    if not x.dtype.is_floating_point:
        return x
    return where(flag, x, detach(x)) if taken_when else where(flag, detach(x), x)


def _bind(select: Graph, offset: int, branch: Graph, inputs: Iterable[Any] | None,
          inputs_dict: Mapping[Tensor, Any] | None) -> dict[Tensor, Any]:
    """Inputs of ``branch`` (positional, then by graph tensor) as inputs of ``select``."""
    bound: dict[Tensor, Any] = {}
    positional = list(inputs or ())
    if len(positional) > len(branch.inputs):
        raise CallInputError(f"conditional: {len(positional)} inputs given for branch '{branch.name}', which has "
                             f"{len(branch.inputs)}", where=context.user_source_line(), fix="pass fewer inputs")
    for i, value in enumerate(positional):
        bound[select.inputs[offset + i]] = value
    for graph_tensor, value in (inputs_dict or {}).items():
        index = next((i for i, t in enumerate(branch.inputs) if t is graph_tensor), None)
        if index is None or select.inputs[offset + index] in bound:
            problem = "is not an input of" if index is None else "is given twice for"
            raise CallInputError(f"conditional: '{getattr(graph_tensor, 'name', graph_tensor)}' {problem} "
                                 f"branch '{branch.name}'", where=context.user_source_line(),
                                 fix="key inputs_dict by the branch graph's input tensors, each once")
        bound[select.inputs[offset + index]] = value
    return bound
