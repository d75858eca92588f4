"""Autodiff of a graph made of calls, unit by unit, without tracing through the calls.

Part of the autodiff pass (``ipuxl.passes.autodiff``, see its module docstring): a
graph with at least ``MIN_CALL_UNITS`` calls of differentiable graphs and no in-place
ops is cut, in program order, into units: each such call, and each run of other ops
between calls (a segment, moved into a graph of its own and differentiated by the
joint trace). The forward becomes a sequence of calls; the grad graph calls each
unit's grad graph in reverse order, summing gradients where a tensor has several
readers (``differentiate_units``).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, cast

import torch
import torch.fx as fx

from ipuxl.errors import AutodiffError
from ipuxl.ir.aliases import writes
from ipuxl.ir.build import emit
from ipuxl.ir.calls import callee, is_repeat
from ipuxl.ir.context import user_source_line
from ipuxl.ir.copy import copy_node
from ipuxl.ir.grad_info import ExpectedConnectionType, GradGraphInfo
from ipuxl.ir.graph import Graph
from ipuxl.ir.meta import BY_REF_ARGS, MODIFIES, NAME
from ipuxl.ir.tensor import Tensor, TensorSpec, keep_layout
from ipuxl.ops.call import CallSiteInfo, call, call_with_info

__all__ = ["differentiate_units", "MIN_CALL_UNITS", "MAX_OP_SEGMENTS", "Unit"]

MIN_CALL_UNITS = 2  # fewer calls: the joint trace is as cheap
MAX_OP_SEGMENTS = 8  # each run of ops between calls is traced on its own

# A unit: ("call", call node), ("ops", [nodes of a segment]) or ("free", node off the gradient path).
Unit = tuple[str, Any]


def differentiate_units(graph: Graph, provided: list[Tensor], required: list[Tensor], explicit: bool,
                        differentiable: Callable[[Graph], bool]) -> GradGraphInfo | None:
    """Differentiate a graph that calls shared graphs without tracing through the calls.

    The graph is cut, in program order, into units: each call of a differentiable
    callee (``differentiable``), and each run of other ops between them (a segment,
    moved into a graph of its own and differentiated with ``autodiff``'s joint
    trace). The forward becomes a sequence of calls; the grad graph is built at the
    IR level, units in reverse:
    each unit's grad graph is called with the gradients of its outputs (summed over
    their readers) and the forward tensors it saved. A joint trace would cost a few
    tensor operations per tensor crossing a call, for every call; this costs one IR
    call per unit. Returns None (use the joint trace) for graphs with in-place ops,
    fewer than ``MIN_CALL_UNITS`` such calls or more than ``MAX_OP_SEGMENTS`` segments.
    """
    nodes = list(graph.fx.nodes)
    if any(writes(n) or MODIFIES in n.meta for n in nodes):
        return None

    def is_unit_call(node: fx.Node) -> bool:
        called = callee(node)
        return (called is not None and not is_repeat(node) and not node.meta.get(BY_REF_ARGS)
                and differentiable(called))

    on_path = _gradient_path(nodes, provided, required)
    units = _units(nodes, on_path, is_unit_call)
    if (sum(kind == "call" for kind, _ in units) < MIN_CALL_UNITS
            or sum(kind == "ops" for kind, _ in units) > MAX_OP_SEGMENTS):
        return None
    infos = _rebuild_as_calls(graph, units, on_path, {t.node for t in provided})
    return _grad_by_units(graph, infos, provided, required, explicit)


def _gradient_path(nodes: list[fx.Node], provided: list[Tensor], required: list[Tensor]) -> set[fx.Node]:
    """What the gradients flow through: nodes reached from the required inputs that
    reach the provided outputs."""
    needs_grad = {t.node for t in required}
    for node in nodes:
        if node not in needs_grad and any(a in needs_grad for a in node.all_input_nodes):
            needs_grad.add(node)
    feeds_output: set[fx.Node] = set()
    stack = [t.node for t in provided]
    while stack:
        node = stack.pop()
        if node not in feeds_output:
            feeds_output.add(node)
            stack.extend(node.all_input_nodes)
    return needs_grad & feeds_output


def _units(nodes: list[fx.Node], on_path: set[fx.Node], is_unit_call: Callable[[fx.Node], bool]) -> list[Unit]:
    """The graph's ops as units, in program order.

    Ops off the gradient path (seeds, masks, metrics) stay in the forward as they are,
    moved ahead of an open run when they do not read it (all ops here are pure), so
    that they do not split runs.
    """
    units: list[Unit] = []
    segment: list[fx.Node] = []
    in_segment: set[fx.Node] = set()
    hoisted: list[fx.Node] = []

    def close() -> None:
        units.extend(("free", n) for n in hoisted)
        if segment:
            units.append(("ops", list(segment)))
        hoisted.clear()
        segment.clear()
        in_segment.clear()

    for node in nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and is_unit_call(_arg_node(node, 0)):
            continue
        if is_unit_call(node):
            close()
            units.append(("call", node))
        elif node in on_path or any(a in in_segment for a in node.all_input_nodes):
            segment.append(node)
            in_segment.add(node)
        elif segment:
            hoisted.append(node)
        else:
            units.append(("free", node))
    close()
    return units


def _rebuild_as_calls(graph: Graph, units: list[Unit], on_path: set[fx.Node],
                      provided: set[fx.Node]) -> list[CallSiteInfo]:
    """Replace ``graph``'s body by one call per unit (segments become graphs); return the
    call sites, in program order."""
    returned = {t.node for t in graph.outputs}
    plans: list[Unit] = [("ops", _segment_graph(graph, unit, returned, on_path, provided)) if kind == "ops"
                         else (kind, unit) for kind, unit in units]
    old_outputs = list(graph.outputs)
    new = fx.Graph()
    node_map: dict[fx.Node, fx.Node] = {}
    for node in graph.fx.nodes:
        if node.op == "placeholder":
            node_map[node] = new.placeholder(cast(str, node.target))
            node_map[node].meta.update(node.meta)
    infos: list[CallSiteInfo] = []
    with graph.rebuild(new, node_map), graph:
        env = _BodyValues(graph, {old: graph.wrap(fresh) for old, fresh in node_map.items()})
        for kind, plan in plans:
            if kind == "free":
                env.copy(plan)
            else:
                infos.append(env.call(kind, plan))
        for handle in old_outputs:  # the caller's output handles stay valid
            if handle.node.op != "placeholder":  # an input: it followed its placeholder already
                node_map[handle.node] = env.value(handle.node).node
    return infos


class _BodyValues:
    """The values of the old body's nodes in the body being rebuilt (``_rebuild_as_calls``)."""

    def __init__(self, graph: Graph, env: dict[fx.Node, Tensor]):
        self.graph, self.env = graph, env

    def value(self, node: fx.Node) -> Tensor:
        if node not in self.env and node.op == "get_attr":  # a constant passed to a call
            fresh = self.graph.fx.get_attr(cast(str, node.target))
            fresh.meta.update(node.meta)
            self.env[node] = self.graph.wrap(fresh)
        return self.env[node]

    def copy(self, node: fx.Node) -> None:
        """An op off the gradient path, copied as it is."""
        fresh = copy_node(node, self.graph.fx, lambda n: self.value(n).node)
        self.env[node] = self.graph.wrap(fresh)

    def call(self, kind: str, plan: Any) -> CallSiteInfo:
        """The call of a segment's graph (``kind == "ops"``) or of a callee, in place of the unit."""
        if kind == "ops":
            sub, ins, outs = plan
            info = call_with_info(sub, *[self.value(n) for n in ins])
            self.env.update(zip(outs, info.outputs))
            return info
        info = call_with_info(cast(Graph, callee(plan)), *[self.value(a) for a in _arg_nodes(plan)])
        for user in plan.users:
            self.env[user] = info.outputs[cast(int, user.args[1])]
        return info


def _segment_graph(graph: Graph, nodes: list[fx.Node], returned: set[fx.Node], on_path: set[fx.Node],
                   provided_nodes: set[fx.Node]) -> tuple[Graph, list[fx.Node], list[fx.Node]]:
    """A run of ``graph``'s ops as a graph of its own, differentiated for the inputs on a
    gradient path (``on_path``) and the outputs a gradient comes back to (provided
    outputs of ``graph``, or read on the path after the run): (graph, input nodes, output nodes)."""
    inside = set(nodes)
    ins: list[fx.Node] = []
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in inside and a.op != "get_attr" and a not in ins:
                ins.append(a)
    outs = [n for n in nodes if n in returned or any(u not in inside for u in n.users)]
    sub = graph.ir.new_subgraph(f"{graph.base_name}_ops")
    copies = _copy_segment(graph, sub, nodes, ins)
    sub.set_outputs([sub.wrap(copies[n]) for n in outs])
    provided = [t for t, n in zip(sub.outputs, outs) if t.dtype.is_floating_point and (
        n in provided_nodes or (n in on_path and any(u not in inside and u in on_path for u in n.users)))]
    required = [t for t, n in zip(sub.inputs, ins) if n in on_path and t.dtype.is_floating_point]
    if provided and required:
        from ipuxl.passes.autodiff import differentiate  # here: autodiff imports this module
        differentiate(sub, provided, required, check_paths=False)
    return sub, ins, outs


def _copy_segment(graph: Graph, sub: Graph, nodes: list[fx.Node], ins: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Copy ``nodes`` into ``sub``, reading ``ins`` as its inputs (constants are copied
    along); return {node of ``graph``: its copy}."""
    env: dict[fx.Node, fx.Node] = {}
    for node in ins:
        val = node.meta["val"]
        env[node] = sub.add_input(TensorSpec(tuple(val.shape), val.dtype), node.meta.get(NAME, node.name)).node
        keep_layout(env[node], val)  # the segment's trace sees the strides it will run on
    for node in nodes:
        for a in node.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                target = cast(str, a.target)
                env[a] = sub.fx.get_attr(target)
                env[a].meta.update(a.meta)
                sub.constant_data[target] = graph.constant_data[target]
        env[node] = copy_node(node, sub.fx, env)  # a view's source is an argument: in env already
    return env


def _grad_by_units(graph: Graph, infos: list[CallSiteInfo], provided: list[Tensor], required: list[Tensor],
                   explicit: bool) -> GradGraphInfo:
    """The grad graph of a graph rebuilt as calls (``infos``): each unit's grad graph called
    in reverse order, gradients summed over readers."""
    grad = graph.ir.new_subgraph(f"{graph.base_name}_grad")
    sums = _GradSums(graph, grad)
    with grad:
        for t in provided:
            sums.add(t.node, grad.add_input(t.spec, f"Gradient___{t.name}"))
        for info in reversed(infos):
            sums.call_unit_grad(info)
        outputs = [_required_grad(graph, sums, t, explicit) for t in required]
    grad.set_outputs(outputs)
    return GradGraphInfo.of(grad, graph, provided, sums.saved_fwd, required)


class _GradSums:
    """Gradients so far while building a grad graph unit by unit, and the forward
    tensors it reads (made forward outputs where needed)."""

    def __init__(self, graph: Graph, grad: Graph):
        self.graph, self.grad = graph, grad
        self.sums: dict[fx.Node, Tensor] = {}  # forward node -> its gradient so far
        self.saved: dict[fx.Node, Tensor] = {}  # forward node -> grad-graph input holding it
        self.saved_fwd: list[Tensor] = []
        self.visible = {id(t) for t in (*graph.inputs, *graph.outputs)}

    def add(self, node: fx.Node, g: Tensor) -> None:
        self.sums[node] = g if node not in self.sums else self.sums[node] + g

    def forward_value(self, t: Tensor) -> Tensor:
        """The grad-graph input holding forward tensor ``t`` (made a forward output if needed)."""
        if t.node not in self.saved:
            fwd = self.graph.wrap(t.node)
            if id(fwd) not in self.visible:
                self.graph.add_output(fwd)
                self.visible.add(id(fwd))
            self.saved[t.node] = self.grad.add_input(fwd.spec, fwd.name)
            self.saved_fwd.append(fwd)
        return self.saved[t.node]

    def call_unit_grad(self, info: CallSiteInfo) -> None:
        """Call the grad graph of the unit called at ``info``, if anything downstream needs it."""
        unit = info.called_graph.grad_info
        if unit is None:
            return
        expected = unit.expected_inputs
        parents = [info.graph_to_parent(c.fwd_tensor) for c in expected]
        fwd_grad = ExpectedConnectionType.FwdGrad
        if not any(c.connection_type is fwd_grad and p.node in self.sums for c, p in zip(expected, parents)):
            return  # nothing downstream needs this unit's gradients
        args = []
        for c, parent in zip(expected, parents):
            if c.connection_type is fwd_grad:
                args.append(self.sums[parent.node] if parent.node in self.sums else _zeros(c.fwd_tensor))
            else:
                args.append(self.forward_value(parent))
        for t, g in zip(unit.outputs, call(unit.graph, *args)):
            self.add(info.graph_to_parent(t).node, g)


def _required_grad(graph: Graph, sums: _GradSums, t: Tensor, explicit: bool) -> Tensor:
    """The gradient of required input ``t`` (zeros without a path, unless ``explicit``)."""
    g = sums.sums.get(t.node)
    if g is None:
        if explicit:
            raise AutodiffError(
                f"autodiff of graph '{graph.name}': input '{t.name}' has no differentiable path to the "
                "outputs in grads_provided (its gradient would always be zero)", where=user_source_line(),
                fix="remove it from grads_required, or check that the outputs use it")
        g = _zeros(t)
    if g.node.op != "placeholder":
        g.node.meta[NAME] = f"Gradient___{t.name}"
    return g


def _zeros(like: Tensor) -> Tensor:
    shape, dtype = list(like.shape), like.spec.dtype
    return emit("zeros", torch.ops.aten.zeros.default, (shape,), {"dtype": dtype, "device": torch.device("cpu")},
                meta_fn=lambda *a, **k: torch.empty(shape, dtype=dtype, device="meta"))



def _arg_node(node: fx.Node, i: int) -> fx.Node:
    """Argument ``i`` of ``node``, a node (a getitem's tuple, say)."""
    return cast(fx.Node, node.args[i])


def _arg_nodes(node: fx.Node) -> list[fx.Node]:
    """The arguments of a call node (all nodes)."""
    return [cast(fx.Node, a) for a in node.args]


