"""Calling subgraphs: ``call``, ``call_with_info``, ``repeat`` and ``CallSiteInfo``.

A call is one fx node whose target names the called graph, so the callee's code
exists once however many sites call it. Inputs are matched to the callee's inputs
positionally, then by ``inputs_dict`` (callee input -> parent tensor). Inputs are
passed by value unless the callee marked them by reference (``TensorByRef``,
``graph_input(by_ref=True)``) or the site calls ``set_parent_input_modified``.
"""
from __future__ import annotations

import operator
from typing import Any, Iterable, Mapping

import torch
import torch.fx as fx

from ipuxl.ir.aliases import storage_owner, written_nodes
from ipuxl.ir.build import check_writable, emit
from ipuxl.ir.graph_builder import constant
from ipuxl.dtypes import dtype_name
from ipuxl.errors import (
    CallIndexError, CallInputError, GraphContextError, InvalidArgumentError, InvalidValueError, ShapeMismatchError,
)
from ipuxl.ir import context
from ipuxl.ir.graph import Graph, describe
from ipuxl.ir.calls import CallTarget, RepeatTarget
from ipuxl.ir.meta import BY_REF, BY_REF_ARGS, CALLED_GRAPH, META_SHAPE, NAME, OP, WRITES
from ipuxl.ir.tensor import Tensor

__all__ = ["CallSiteInfo", "call", "call_with_info", "mark_by_ref", "repeat", "repeat_with_info"]


class CallSiteInfo:
    """What one call of a subgraph connects: parent tensors <-> callee tensors."""

    def __init__(self, node: fx.Node, called_graph: Graph, parent: Graph, inputs: list[Tensor]):
        self._node = node
        self._graph = called_graph
        self._parent = parent
        self._inputs = inputs
        self._outputs: list[Tensor] = []

    @property
    def called_graph(self) -> Graph:
        return self._graph

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(self._inputs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        """Parent tensors of the callee's outputs (including outputs added later by autodiff)."""
        n = self._num_outputs()
        while len(self._outputs) < n:
            self._outputs.append(self._output_item(len(self._outputs)))
        return tuple(self._outputs)

    def _num_outputs(self) -> int:
        return len(self._graph.outputs)

    def _output_item(self, i: int) -> Tensor:
        item = self._parent.fx.create_node("call_function", operator.getitem, (self._node, i), {},
                                           name=f"{self._node.name}_out{i}")
        out = self._graph.outputs[i]
        item.meta["val"] = _meta_copy(out.node.meta["val"])
        item.meta[NAME] = out.name
        item.meta[OP] = "output_of"
        if out.meta_shape:  # a replica shard stays one in the caller (PopXL copies the tensor info)
            item.meta[META_SHAPE] = out.meta_shape
        return self._parent.wrap(item)

    def parent_input(self, idx: int) -> Tensor:
        return self._inputs[idx]

    def parent_output(self, idx: int) -> Tensor:
        return self.outputs[idx]

    # Inputs and outputs of a call are in the called graph's order, so each index maps to itself.
    def graph_to_parent_input_index(self, idx: int) -> int:
        """The call-site input index of the called graph's input ``idx``."""
        return self._checked_index(idx, len(self._graph.inputs), "graph input")

    def parent_to_graph_input_index(self, idx: int) -> int:
        """The called graph's input index of call-site input ``idx``."""
        return self._checked_index(idx, len(self._inputs), "parent input")

    def graph_to_parent_output_index(self, idx: int) -> int:
        """The call-site output index of the called graph's output ``idx``."""
        return self._checked_index(idx, self._num_outputs(), "graph output")

    def parent_to_graph_output_index(self, idx: int) -> int:
        """The called graph's output index of call-site output ``idx``."""
        return self._checked_index(idx, self._num_outputs(), "parent output")

    def _checked_index(self, idx: int, count: int, kind: str) -> int:
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise InvalidArgumentError(f"{kind} index must be an int, got {type(idx).__name__}",
                                       where=context.user_source_line())
        if not 0 <= idx < count:
            raise CallIndexError(f"{kind} index {idx} is out of range: this call of '{self._graph.name}' has "
                                 f"{count} {kind}s", where=context.user_source_line(),
                                 fix=f"use an index in [0, {count})")
        return idx

    def graph_to_parent(self, graph_tensor: Tensor) -> Tensor:
        """The parent tensor connected to callee input or output ``graph_tensor``."""
        for i, t in enumerate(self._graph.inputs):
            if t is graph_tensor:
                return self._inputs[i]
        for i, t in enumerate(self._graph.outputs):
            if t is graph_tensor:
                return self.outputs[i]
        raise CallInputError(
            f"tensor '{graph_tensor.name}' is not an input or output of the called graph '{self._graph.name}'",
            where=context.user_source_line(), fix="pass a tensor from called_graph.inputs or called_graph.outputs")

    def parent_to_graph(self, parent_tensor: Tensor) -> Tensor:
        """The callee input that ``parent_tensor`` is connected to (first if several)."""
        return self._graph.inputs[self._parent_index(parent_tensor)]

    def set_parent_input_modified(self, parent_tensor: Tensor, infer_modified_regions: bool = True) -> None:
        """Pass ``parent_tensor`` by reference: the callee's in-place changes reach the parent."""
        index = self._parent_index(parent_tensor)
        check_writable(self._parent, f"call of {self._graph.name}", [parent_tensor])
        mark_by_ref(self._node, index, parent_tensor)

    def _parent_index(self, parent_tensor: Tensor) -> int:
        """The position of ``parent_tensor`` among the call's inputs (the first if several)."""
        index = next((i for i, t in enumerate(self._inputs) if t is parent_tensor), None)
        if index is None:
            raise CallInputError(
                f"tensor '{parent_tensor.name}' is not a parent input of this call of '{self._graph.name}'",
                where=context.user_source_line(), fix="pass one of call_info.inputs")
        return index


def mark_by_ref(node: fx.Node, index: int, parent_tensor: Tensor) -> None:
    """Have call ``node`` pass its argument ``index`` (``parent_tensor``) by reference: the
    callee's in-place writes of that input reach the caller's tensor."""
    node.meta.setdefault(BY_REF_ARGS, set()).add(index)
    writes = node.meta.setdefault(WRITES, [])
    root = storage_owner(parent_tensor.node, views=False)
    if root not in writes:
        writes.append(root)


def call(graph: Graph, *inputs: Any, inputs_dict: Mapping[Tensor, Any] | None = None) -> tuple[Tensor, ...]:
    """Call ``graph``; returns the parent tensors of its outputs (always a tuple)."""
    return call_with_info(graph, *inputs, inputs_dict=inputs_dict).outputs


def call_with_info(graph: Graph, *inputs: Any, inputs_dict: Mapping[Tensor, Any] | None = None,
                   check_inputs: bool = True) -> CallSiteInfo:
    """Call ``graph`` and return the ``CallSiteInfo`` describing the call site."""
    parent = context.gcg()
    connected = _connect_inputs(parent, graph, inputs, inputs_dict)
    target = CallTarget(graph)
    return _emit_call("call", target, parent, graph, connected)


def repeat(graph: Graph, repeat_count: int, *inputs: Any,
           inputs_dict: Mapping[Tensor, Any] | None = None) -> tuple[Tensor, ...]:
    """Run ``graph`` ``repeat_count`` times on the device (see ``repeat_with_info``)."""
    return repeat_with_info(graph, repeat_count, *inputs, inputs_dict=inputs_dict).outputs


def repeat_with_info(graph: Graph, repeat_count: int, *inputs: Any,
                     inputs_dict: Mapping[Tensor, Any] | None = None, check_inputs: bool = True) -> CallSiteInfo:
    """A device-side loop: outputs ``i`` feed inputs ``i`` of the next iteration.

    With N graph outputs the first N inputs are loop-carried (their specs must match
    the outputs'); later inputs are the same every iteration. Returns the N values
    after the last iteration (the initial values when ``repeat_count`` is 0).
    """
    parent = context.gcg()
    if isinstance(repeat_count, bool) or not isinstance(repeat_count, int):
        raise InvalidArgumentError(f"repeat count must be an int, got {repeat_count!r} for graph '{graph.name}'",
                                   where=context.user_source_line())
    if repeat_count < 0:
        raise InvalidValueError(f"repeat count must be >= 0, got {repeat_count} for graph '{graph.name}'",
                                where=context.user_source_line(), fix="use 0 to run it no times")
    n_out = len(graph.outputs)
    if len(graph.inputs) < n_out:
        raise CallInputError(
            f"to repeat graph '{graph.name}' it needs at least as many inputs as outputs "
            f"({len(graph.inputs)} < {n_out})", where=context.user_source_line(),
            fix="the first N inputs are loop-carried from the N outputs; add matching inputs")
    for i, (t_in, t_out) in enumerate(zip(graph.inputs, graph.outputs)):
        if not t_in.spec.same_data(t_out.spec):
            raise ShapeMismatchError(
                f"repeat of graph '{graph.name}': loop-carried input {i} {describe(t_in)} does not match "
                f"output {i} {describe(t_out)}", where=context.user_source_line(),
                fix="make output i the same shape and dtype as input i")
    connected = _connect_inputs(parent, graph, inputs, inputs_dict)
    return _emit_call("repeat", RepeatTarget(graph, repeat_count), parent, graph, connected)


def _emit_call(op_name: str, target: CallTarget, parent: Graph, graph: Graph,
               connected: list[Tensor]) -> CallSiteInfo:
    handle = emit(op_name, target, connected, name=f"{op_name}_{graph.name}",
                  meta_fn=lambda *a: tuple(_meta_copy(o.node.meta["val"]) for o in graph.outputs))
    node = handle.node
    node.meta[CALLED_GRAPH] = graph
    info = CallSiteInfo(node, graph, parent, connected)
    written = written_nodes(graph)
    for i, t in enumerate(graph.inputs):
        if t.node.meta.get(BY_REF):
            if t.node in written:  # the callee's write reaches the caller's tensor: never a constant
                check_writable(parent, f"{op_name} of {graph.name}", [connected[i]])
            mark_by_ref(node, i, connected[i])
    return info


def _meta_copy(value: torch.Tensor) -> torch.Tensor:
    """A meta tensor like ``value`` (``empty_like`` works out the memory format: slow)."""
    if value.is_contiguous():
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return torch.empty_like(value, device="meta")


def _connect_inputs(parent: Graph, graph: Graph, inputs: Iterable[Any],
                    inputs_dict: Mapping[Tensor, Any] | None) -> list[Tensor]:
    """Match call arguments to the callee's inputs; check specs; make constants of numbers."""
    if not isinstance(graph, Graph):
        raise InvalidArgumentError(f"ops.call needs a Graph, got {type(graph).__name__}",
                                   where=context.user_source_line(),
                                   fix="create the graph with ir.create_graph(fn, ...)")
    if graph is parent or graph.is_main:
        raise GraphContextError(f"graph '{graph.name}' cannot call itself or the main graph",
                                where=context.user_source_line())
    flat: list[Any] = []
    for value in inputs:
        flat.extend(value if isinstance(value, (list, tuple)) else [value])
    slots: list[Any] = [None] * len(graph.inputs)
    if len(flat) > len(slots):
        raise CallInputError(
            f"{len(flat)} positional inputs given to graph '{graph.name}', which has {len(slots)} inputs",
            where=context.user_source_line(), fix=f"its inputs are: {_names(graph.inputs)}")
    slots[:len(flat)] = flat
    for key, value in (inputs_dict or {}).items():
        index = next((i for i, t in enumerate(graph.inputs) if t is key), None)
        if index is None:
            raise CallInputError(
                f"inputs_dict key {key!r} is not an input of the called graph '{graph.name}'",
                where=context.user_source_line(), fix=f"its inputs are: {_names(graph.inputs)}")
        if slots[index] is not None:
            raise CallInputError(f"input '{key.name}' of graph '{graph.name}' is given twice",
                                       where=context.user_source_line(),
                                       fix="give it either positionally or in inputs_dict")
        slots[index] = value
    missing = [t.name for t, v in zip(graph.inputs, slots) if v is None]
    if missing:
        raise CallInputError(
            f"call of graph '{graph.name}' is missing inputs {missing}", where=context.user_source_line(),
            fix="pass them positionally or with inputs_dict={graph_input: parent_tensor}")
    return [_connect_one(graph, t, v) for t, v in zip(graph.inputs, slots)]


def _connect_one(graph: Graph, graph_input: Tensor, value: Any) -> Tensor:
    if not isinstance(value, Tensor):
        value = constant(value, dtype=graph_input.dtype, name=f"{graph_input.name}_const")
    if not value.spec.same_data(graph_input.spec):
        raise ShapeMismatchError(
            f"call of graph '{graph.name}': input '{graph_input.name}' expects "
            f"{graph_input.shape} {dtype_name(graph_input.dtype)}, got {describe(value)}",
            where=context.user_source_line(),
            fix="pass a tensor of the shape and dtype the graph was created with (or create another graph)")
    return value


def _names(tensors: Iterable[Tensor]) -> list[str]:
    return [t.name for t in tensors]
