"""Automatic differentiation of an IR graph with PyTorch's own machinery.

Preconditions: ``graph`` is a subgraph (not the main graph) without host transfers
or collectives.

Algorithm:

1. Lower the forward graph to a callable and trace the *joint* function
   ``(primals, tangents) -> (all forward outputs, grads of grads_required)`` with
   ``make_fx`` over ``torch.func.vjp`` (fake tensors: no data is computed). The
   backward is traced with grad mode off (``create_graph=False``), as eager runs it,
   so autograd's formulas pick their fused kernels (``silu_backward``...).
2. Tag every joint node forward (an ancestor of a forward output) or backward, so
   functorch's ``default_partition`` splits there instead of recomputing the
   forward in the backward (see the DESIGN note on ``partitioner_tag``). Views of
   the graph's inputs that the backward reads (``t(weight)``) are the exception: they
   are recomputed in the backward from the saved input (``_recompute_input_views``).
3. Partition into forward-with-saved-activations and backward graphs.
4. Rewrite the forward IR graph with the partitioned forward
   (``Graph.replace_body``): its inputs and existing outputs keep their positions
   and handles; activations the backward needs become new outputs (unless they
   already are inputs or outputs), as in PopXL.
5. Build the grad IR graph: inputs are the gradients of ``grads_provided`` (in
   order) then the activations; outputs are the gradients of ``grads_required``.

The result is a ``GradGraphInfo``, also stored on the forward graph (``Graph.grad_info``).

Called graphs stay called. Each graph that ``graph`` calls (``ops.call``) is
differentiated once, recursively and in place as PopXL does (it gains outputs for
its saved activations and gets its own grad graph); the grad graph then calls that
grad graph once per forward call, so a callee called N times costs one
differentiation, and no graph holds N copies of its ops. Two ways:

* a graph with at least ``MIN_CALL_UNITS`` such calls and no in-place ops is
  differentiated unit by unit at the IR level (``_differentiate_units``): the runs
  of ops between calls become graphs of their own, differentiated with steps 1-5,
  and the grad graph is built by calling each unit's grad graph in reverse order,
  summing gradients where a tensor has several readers. Nothing traces the calls;
* otherwise, in the joint trace, every call is one ``ipuxl::call_graph`` node whose
  backward calls the callee's grad graph (``ir.call_op.CallGraphFunction``).

Callees that cannot be handled so are traced through (inlined) as before: loop
bodies (``ops.repeat``), graphs that modify an input in place, graphs with host
transfers, graphs already differentiated by an earlier ``autodiff``, and graphs
without a floating-point input and output.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Literal, Mapping, NoReturn, Sequence, cast, overload

import torch
import torch.fx as fx
from torch._functorch.partitioners import default_partition
from torch.fx.experimental.proxy_tensor import make_fx

from ipuxl.dtypes import dtype_name
from ipuxl.errors import AutodiffError
from ipuxl.ir.aliases import writes, written_nodes
from ipuxl.ir.build import emit
from ipuxl.ir.call_op import CallEntry
from ipuxl.ir.calls import call_nodes, callee, does_host_io, is_repeat, reachable_from, transfer_counts
from ipuxl.ir.context import user_source_line
from ipuxl.ir.fx_import import copy_fx_body, returns_view
from ipuxl.ir.grad_info import ExpectedConnectionType, GradGraphInfo
from ipuxl.ir.graph import Graph
from ipuxl.ir.lower import compiled_callee, graph_callable, lower_graph
from ipuxl.ir.meta import BY_REF_ARGS, COLLECTIVE_OPS, MODIFIES, NAME, OP, SOURCE, VIEW_OF
from ipuxl.ir.tensor import Tensor, TensorSpec
from ipuxl.kernels import tp_collectives
from ipuxl.ops.call import CallSiteInfo, call, call_with_info

__all__ = ["autodiff", "differentiate"]

FWD_TAG, BWD_TAG = "is_forward", "is_backward"


# -- the transform (PopXL's transforms.autodiff) -----------------------------------------------
@overload
def autodiff(graph: Graph, grads_provided: Iterable[Tensor] | None = None,
             grads_required: Iterable[Tensor] | None = None,
             called_graphs_grad_info: Mapping[Graph, GradGraphInfo] | None = None,
             return_all_grad_graphs: Literal[False] = False) -> GradGraphInfo: ...


@overload
def autodiff(graph: Graph, grads_provided: Iterable[Tensor] | None = None,
             grads_required: Iterable[Tensor] | None = None,
             called_graphs_grad_info: Mapping[Graph, GradGraphInfo] | None = None,
             *, return_all_grad_graphs: Literal[True]) -> dict[Graph, GradGraphInfo]: ...


def autodiff(graph: Graph, grads_provided: Iterable[Tensor] | None = None,
             grads_required: Iterable[Tensor] | None = None,
             called_graphs_grad_info: Mapping[Graph, GradGraphInfo] | None = None,
             return_all_grad_graphs: bool = False) -> GradGraphInfo | dict[Graph, GradGraphInfo]:
    """Differentiate ``graph`` (PopXL's ``transforms.autodiff``).

    Args:
        graph: the forward subgraph.
        grads_provided: outputs whose gradients the caller provides (default: all
            floating-point outputs).
        grads_required: inputs whose gradients the grad graph returns (default: all
            floating-point inputs).
        called_graphs_grad_info: accepted for compatibility and not used: each graph
            ``graph`` calls is differentiated once by this call, in place (it gains
            outputs for its saved activations), and its calls stay calls in the
            forward and grad graphs (see the module docstring); loop bodies and graphs
            that modify their inputs are traced through instead.
        return_all_grad_graphs: return ``{graph: info}`` for ``graph`` and every
            called graph this call differentiated, instead of the info.

    Returns:
        A ``GradGraphInfo``. The forward graph gains outputs for the activations the
        grad graph needs; the backward never recomputes the forward.

    Raises:
        AutodiffError: a requested gradient has no differentiable path, a tensor is
            not an input/output of ``graph``, the graph contains a collective other
            than ``replicated_all_gather``, a Streaming Memory op (``remote_load``,
            ``remote_load_``, ``remote_store``, ``remote_code_load``: no gradient), or
            there is nothing to differentiate: no floating-point output (of the graph,
            or in ``grads_provided``) or, with the default ``grads_required``, no
            floating-point input. Checked before anything is traced.
    """
    _refuse_collectives(graph)
    _refuse_remote_ops(graph)
    provided = list(grads_provided) if grads_provided is not None else None
    required = list(grads_required) if grads_required is not None else None
    info = differentiate(graph, provided, required)
    if not return_all_grad_graphs:
        return info
    return {graph: info, **_differentiated_callees(graph)}


#: Collectives with a gradient rule (``replicated_all_gather``: a reduce-scatter, as in PopXL;
#: popxl.addons' ``replicated_all_reduce_TP``: see ``ipuxl.kernels.tp_collectives``).
DIFFERENTIABLE_COLLECTIVES = ("replicated_all_gather", "replicated_all_reduce_TP")


def _refuse_collectives(graph: Graph) -> None:
    """Collectives other than ``DIFFERENTIABLE_COLLECTIVES`` have no gradient rule yet: say so
    instead of failing inside the trace."""
    for g in reachable_from([graph]):
        for node in g.fx.nodes:
            if node.meta.get(OP) in COLLECTIVE_OPS and node.meta[OP] not in DIFFERENTIABLE_COLLECTIVES:
                raise AutodiffError(
                    f"autodiff of graph '{g.name}': it contains {node.meta[OP]} ('{node.name}'), "
                    "and differentiating through collectives is not supported",
                    where=node.meta.get(SOURCE),
                    fix="differentiate the per-replica computation, then all-reduce its gradients in the caller "
                        "(ops.collectives.replicated_all_reduce_(grad, 'mean')), the usual data-parallel pattern")


#: Streaming Memory ops: PopART's remote load/store/code-load ops have no grad ops.
REMOTE_OPS = ("remote_load", "remote_load_", "remote_store", "remote_code_load")


def _refuse_remote_ops(graph: Graph) -> None:
    """Streaming Memory ops have no gradient (PopART defines no grad op for them) and need a
    device to run: refuse a graph that contains one, before anything is traced."""
    for g in reachable_from([graph]):
        for node in g.fx.nodes:
            if node.meta.get(OP) in REMOTE_OPS:
                inside = f"graph '{g.name}'" if g is graph else f"graph '{g.name}' (called from '{graph.name}')"
                raise AutodiffError(
                    f"autodiff of graph '{graph.name}': {inside} contains {node.meta[OP]} ('{node.name}'); "
                    "Streaming Memory ops (remote_load, remote_load_, remote_store, remote_code_load) have no "
                    "gradient and cannot be part of a differentiated graph",
                    where=node.meta.get(SOURCE),
                    fix="load in the caller and pass the loaded tensor to the graph as an input (PopXL's phased "
                        "execution: remote_load in the main graph, call the forward/grad graphs, then "
                        "remote_store the updated tensors); code-load graphs in the caller too")


def _differentiated_callees(graph: Graph) -> dict[Graph, GradGraphInfo]:
    """Graphs called (at any depth) from ``graph`` that autodiff differentiated in place."""
    return {g: g.grad_info for g in reachable_from([graph])[1:] if g.grad_info is not None}


# -- the pass ------------------------------------------------------------------------------------
def differentiate(graph: Graph, grads_provided: Sequence[Tensor] | None, grads_required: Sequence[Tensor] | None,
                  *, check_paths: bool = True) -> GradGraphInfo:
    """Differentiate ``graph`` (see the module docstring); store and return its ``GradGraphInfo``.

    ``check_paths``: refuse an explicitly required input without a differentiable
    path to the provided outputs (off for the segments autodiff cuts itself).
    """
    provided, required = _select(graph, grads_provided, grads_required)
    callees = _CalledGraphs(graph)  # holds the call entries until the trace is imported
    explicit = grads_required is not None and check_paths
    info = _differentiate_units(graph, provided, required, explicit, callees)
    if info is None:
        info = _differentiate_traced(graph, provided, required, explicit, callees)
    graph.grad_info = info
    return info


def _differentiate_traced(graph: Graph, provided: list[Tensor], required: list[Tensor], explicit: bool,
                          callees: "_CalledGraphs") -> GradGraphInfo:
    """Steps 1-5 of the module docstring."""
    joint = _trace_joint(graph, provided, required, callees)
    n_fwd = len(graph.outputs)
    _check_paths(graph, joint, n_fwd, required, explicit)
    _tag_forward(joint, n_fwd)
    _recompute_input_views(joint)
    fw, bw = default_partition(joint, None, num_fwd_outputs=n_fwd)
    saved = _rewrite_forward(graph, fw, n_fwd)
    grad_graph = _build_grad_graph(graph, bw, provided, saved, required)
    return GradGraphInfo.of(grad_graph, graph, provided, [t for _, t in saved], required)


# -- step 0b: called graphs ------------------------------------------------------------------
class _CalledGraphs:
    """The graphs ``graph`` calls, each differentiated once, as differentiable call entries."""

    def __init__(self, graph: Graph):
        self._entries: dict[Graph, CallEntry | None] = {}
        self._loop_bodies = _loop_bodies(graph)

    def entry(self, callee: Graph) -> CallEntry | None:
        if callee not in self._entries:
            self._entries[callee] = self._prepare(callee) if self._eligible(callee) else None
        return self._entries[callee]

    def _eligible(self, callee: Graph) -> bool:
        if callee in self._loop_bodies or callee.grad_info is not None:
            return False
        if any(callee.is_input_modified(t) for t in callee.inputs):
            return False
        if does_host_io(callee):
            return False
        return (any(t.dtype.is_floating_point for t in callee.inputs)
                and any(t.dtype.is_floating_point for t in callee.outputs))

    def _prepare(self, callee: Graph) -> CallEntry:
        info = differentiate(callee, None, None)
        grad_graph = info.graph
        grad_entry = CallEntry(grad_graph.name, [t.spec for t in grad_graph.outputs], graph=grad_graph,
                               run=_eager(grad_graph))
        self._entries[grad_graph] = grad_entry  # kept alive with the forward entry
        return CallEntry(callee.name, [t.spec for t in callee.outputs], graph=callee,
                         backward=_backward_rule(callee, info, grad_entry), run=_eager(callee))


def _backward_rule(callee: Graph, info: GradGraphInfo, grad_entry: CallEntry) -> Callable[..., list]:
    """The gradient rule of a call of ``callee``: call its grad graph (``info``)."""
    inputs = {id(t): i for i, t in enumerate(callee.inputs)}
    outputs = {id(t): i for i, t in enumerate(callee.outputs)}

    def backward(args: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                 grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        grad_args = []
        for c in info.expected_inputs:
            t = c.fwd_tensor
            if c.connection_type is ExpectedConnectionType.FwdGrad:
                g = grads[outputs[id(t)]]
                grad_args.append(torch.zeros(t.shape, dtype=t.spec.dtype, device=args[0].device) if g is None else g)
            else:
                grad_args.append(args[inputs[id(t)]] if id(t) in inputs else outs[outputs[id(t)]])
        result: list[torch.Tensor | None] = [None] * len(args)
        for t, g in zip(info.outputs, grad_entry(*grad_args)):
            result[inputs[id(t)]] = g
        return result

    return backward


def _loop_bodies(graph: Graph) -> set[Graph]:
    """Graphs run by ``ops.repeat`` anywhere below ``graph`` (their outputs feed their inputs)."""
    return {body for g in reachable_from([graph]) for n in call_nodes(g)
            if is_repeat(n) and (body := callee(n)) is not None}


def _eager(graph: Graph) -> Callable[..., Any]:
    return lambda *args: graph_callable(graph)(*args)


def _forward_callable(graph: Graph, callees: _CalledGraphs) -> Callable[..., Any]:
    """``graph`` lowered for the joint trace: eligible callees become call entries."""
    cache: dict[Graph, Any] = {}

    def callee_fn(g: Graph) -> Any:
        if g not in cache:
            entry = callees.entry(g)
            cache[g] = compiled_callee(g, entry if entry is not None else lower_graph(g, callee_fn).forward)
        return cache[g]

    return compiled_callee(graph, lower_graph(graph, callee_fn).forward)


# -- step 0: which gradients ------------------------------------------------------------
def _select(graph: Graph, provided: Sequence[Tensor] | None,
            required: Sequence[Tensor] | None) -> tuple[list[Tensor], list[Tensor]]:
    if graph.is_main:
        raise AutodiffError("autodiff of the main graph is not supported",
                            where=user_source_line(),
                            fix="build the forward pass as a subgraph with ir.create_graph and call it")
    if does_host_io(graph):
        streams = ", ".join(f"'{s.name}'" for s in transfer_counts(graph))
        raise AutodiffError(f"graph '{graph.name}' does host transfers of stream {streams} (itself or in a graph "
                            "it calls) and cannot be differentiated", where=user_source_line(),
                            fix="load the data in the caller and pass it to the graph as an input")
    outs = list(graph.outputs) if provided is None else list(provided)
    ins = [t for t in graph.inputs if t.dtype.is_floating_point] if required is None else list(required)
    for t in outs:
        _require_member(t, graph.outputs, graph, "grads_provided", "an output")
    for t in ins:
        _require_member(t, graph.inputs, graph, "grads_required", "an input")
        if not t.dtype.is_floating_point:
            raise AutodiffError(f"autodiff of graph '{graph.name}': input '{t.name}' has dtype {dtype_name(t.dtype)}, "
                                "which has no gradient", where=user_source_line(),
                                fix="list only floating-point inputs in grads_required")
    float_outs = [t for t in outs if t.dtype.is_floating_point]
    if not float_outs:
        _refuse_empty(graph, "outputs", provided is not None, outs)
    if not ins and required is None:  # an explicit empty grads_required asks for no gradients
        _refuse_empty(graph, "inputs", False, list(graph.inputs))
    return float_outs, ins


def _refuse_empty(graph: Graph, side: str, explicit: bool, tensors: list[Tensor]) -> NoReturn:
    """Nothing to differentiate: say which side has no floating-point tensor, before tracing."""
    listed = ", ".join(f"'{t.name}' ({dtype_name(t.dtype)})" for t in tensors) or "none"
    if side == "outputs":
        problem = (f"grads_provided holds no floating-point output (given: {listed})" if explicit else
                   f"it has no floating-point outputs to take gradients of (outputs: {listed})")
        fix = ("list floating-point outputs in grads_provided" if explicit else
               "return a floating-point result (cast with ops.cast(t, ipuxl.float32)), or do not differentiate "
               "this graph: integer and bool tensors have no gradient")
    else:
        problem = f"it has no floating-point inputs to differentiate with respect to (inputs: {listed})"
        fix = ("make an input floating-point (cast it before the call with ops.cast(t, ipuxl.float32)), or do "
               "not differentiate this graph: integer and bool tensors have no gradient")
    line = user_source_line()
    raise AutodiffError(f"autodiff of graph '{graph.name}': {problem}",
                        where=f"{line}, graph '{graph.name}'" if line else f"graph '{graph.name}'", fix=fix)


def _require_member(t: Tensor, members: Sequence[Tensor], graph: Graph, arg: str, what: str) -> None:
    if not any(t is m for m in members):
        raise AutodiffError(f"autodiff of graph '{graph.name}': {arg} contains '{getattr(t, 'name', t)}', "
                            f"which is not {what} of the graph", where=user_source_line(),
                            fix=f"pass tensors from graph.{'outputs' if what == 'an output' else 'inputs'}")


# -- graphs made of calls: differentiate unit by unit -------------------------------------------
MIN_CALL_UNITS = 2  # fewer calls: the joint trace below is as cheap
MAX_OP_SEGMENTS = 8  # each run of ops between calls is traced on its own

# A unit: ("call", call node), ("ops", [nodes of a segment]) or ("free", node off the gradient path).
Unit = tuple[str, Any]


def _differentiate_units(graph: Graph, provided: list[Tensor], required: list[Tensor], explicit: bool,
                         callees: _CalledGraphs) -> GradGraphInfo | None:
    """Differentiate a graph that calls shared graphs without tracing through the calls.

    The graph is cut, in program order, into units: each call of a differentiable
    callee, and each run of other ops between them (a segment, moved into a graph of
    its own and differentiated with the joint trace below). The forward becomes a
    sequence of calls; the grad graph is built at the IR level, units in reverse:
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
                and callees.entry(called) is not None)

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
        fresh = self.graph.fx.node_copy(node, lambda n: self.value(n).node)
        if VIEW_OF in node.meta:
            fresh.meta[VIEW_OF] = self.value(node.meta[VIEW_OF]).node
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
        differentiate(sub, provided, required, check_paths=False)
    return sub, ins, outs


def _copy_segment(graph: Graph, sub: Graph, nodes: list[fx.Node], ins: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Copy ``nodes`` into ``sub``, reading ``ins`` as its inputs (constants are copied
    along); return {node of ``graph``: its copy}."""
    env: dict[fx.Node, fx.Node] = {}
    for node in ins:
        val = node.meta["val"]
        env[node] = sub.add_input(TensorSpec(tuple(val.shape), val.dtype), node.meta.get(NAME, node.name)).node
    for node in nodes:
        for a in node.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                target = cast(str, a.target)
                env[a] = sub.fx.get_attr(target)
                env[a].meta.update(a.meta)
                sub.constant_data[target] = graph.constant_data[target]
        copied = sub.fx.node_copy(node, lambda n: env[n])
        view_of = node.meta.get(VIEW_OF)
        if view_of is not None:
            copied.meta[VIEW_OF] = env.get(view_of, copied.all_input_nodes[0] if copied.all_input_nodes else None)
        env[node] = copied
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


# -- step 1: joint trace ----------------------------------------------------------------------
def _trace_joint(graph: Graph, provided: list[Tensor], required: list[Tensor],
                 callees: _CalledGraphs) -> fx.GraphModule:
    forward = _forward_callable(graph, callees)
    outs_idx = [_index(graph.outputs, t) for t in provided]
    req_idx = [_index(graph.inputs, t) for t in required]
    # Inputs the graph updates in place are copied, as a by-value call does.
    written = written_nodes(graph)
    modified = [i for i, t in enumerate(graph.inputs) if t.node in written]

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> tuple:
        def f(*req: torch.Tensor) -> tuple:
            args = list(primals)
            for i, r in zip(req_idx, req):
                args[i] = r
            for i in modified:
                args[i] = args[i].clone()
            outs = forward(*args)
            return tuple(outs[j] for j in outs_idx), tuple(outs)

        # with has_aux, vjp returns (outputs, vjp_fn, aux); torch's annotation knows only the pair
        vjp = torch.func.vjp(f, *[primals[i] for i in req_idx], has_aux=True)
        _, vjp_fn, all_outs = cast(tuple[Any, Callable[..., tuple], tuple], vjp)
        # create_graph=False: the backward runs with grad mode off, as eager's does, so
        # autograd picks its fused backward kernels (silu_backward, not the twice-
        # differentiable composite it uses when a graph of the backward is kept)
        grads = vjp_fn(tuple(tangents), create_graph=False) if req_idx else ()
        return (*all_outs, *grads)

    primals = [torch.zeros(t.shape, dtype=t.spec.dtype) for t in graph.inputs]
    tangents = [torch.zeros(t.shape, dtype=t.spec.dtype) for t in provided]
    # constants (and variables read by the graph) are real tensors of the lowered module
    return make_fx(joint, tracing_mode="fake", _allow_non_fake_inputs=True)(primals, tangents)


def _index(tensors: Sequence[Tensor], t: Tensor) -> int:
    return next(i for i, m in enumerate(tensors) if m is t)


def _output_args(graph: fx.Graph) -> list[Any]:
    """The values an fx graph returns (its output node's tuple)."""
    return list(cast(Sequence[Any], graph.output_node().args[0]))


def _arg_node(node: fx.Node, i: int) -> fx.Node:
    """Argument ``i`` of ``node``, a node (a getitem's tuple, say)."""
    return cast(fx.Node, node.args[i])


def _arg_nodes(node: fx.Node) -> list[fx.Node]:
    """The arguments of a call node (all nodes)."""
    return [cast(fx.Node, a) for a in node.args]


def _check_paths(graph: Graph, joint: fx.GraphModule, n_fwd: int, required: list[Tensor], explicit: bool) -> None:
    """Raise when an explicitly required gradient does not depend on any provided gradient."""
    if not explicit:
        return
    grads = _output_args(joint.graph)[n_fwd:]
    reached = _tangent_dependent(joint)
    for t, grad in zip(required, grads):
        if grad not in reached:
            raise AutodiffError(
                f"autodiff of graph '{graph.name}': input '{t.name}' has no differentiable path to the "
                "outputs in grads_provided (its gradient would always be zero)", where=user_source_line(),
                fix="remove it from grads_required, or check that the outputs use it (ops.detach stops gradients)")


def _tangent_dependent(joint: fx.GraphModule) -> set[fx.Node]:
    """Nodes that depend on a tangent input (one pass in program order)."""
    reached: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


# -- step 2: tags -----------------------------------------------------------------------------------
def _tag_forward(joint: fx.GraphModule, n_fwd: int) -> None:
    forward_nodes: set[fx.Node] = set()
    stack = [n for n in _output_args(joint.graph)[:n_fwd] if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in forward_nodes:
            forward_nodes.add(node)
            stack.extend(node.all_input_nodes)
    # Every result of a forward op with several results is forward too (nll_loss_forward's
    # total_weight, max_pool's indices...): tagged backward, a result the backward reads
    # would make the partitioner run the whole op again in the backward.
    for node in list(forward_nodes):
        if node.users and all(user.op == "call_function" and user.target is operator.getitem
                              for user in node.users):
            forward_nodes.update(node.users)
    for node in joint.graph.nodes:
        if node.op in ("call_function", "get_attr"):
            node.meta["partitioner_tag"] = FWD_TAG if node in forward_nodes else BWD_TAG


def _recompute_input_views(joint: fx.GraphModule) -> None:
    """Views of the graph's inputs that the backward reads (``t(weight)``, a permuted
    input...) are recomputed in the backward from the input, which is saved instead.
    Saved as they are, they would be forward outputs sharing an input's storage, which
    a call copies (its outputs are new tensors): a copy of every transposed weight per
    step. Each such view chain gets a copy tagged backward, placed before the first
    backward reader (the partitioner keeps the graph's order), read by the backward."""
    graph = joint.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    readers = {node: [u for u in node.users if u.meta.get("partitioner_tag") == BWD_TAG]
               for node in graph.nodes
               if node.meta.get("partitioner_tag") == FWD_TAG and returns_view(node.target) and _input_view(node)}
    readers = {node: users for node, users in readers.items() if users}
    if not readers:
        return
    anchor = min((u for users in readers.values() for u in users), key=order.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}

    def backward_copy(node: fx.Node) -> fx.Node:
        if node.op == "placeholder":
            return node
        if node not in copies:
            source = backward_copy(cast(fx.Node, node.args[0]))
            with graph.inserting_before(anchor):
                copy = graph.call_function(cast(Callable[..., Any], node.target), (source, *node.args[1:]),
                                           dict(node.kwargs))
            copy.meta.update(node.meta)
            copy.meta["partitioner_tag"] = BWD_TAG
            copies[node] = copy
        return copies[node]

    for node, users in readers.items():
        copy = backward_copy(node)
        for user in users:
            user.replace_input_with(node, copy)


def _input_view(node: fx.Node) -> bool:
    """Whether ``node`` is a chain of views of a placeholder."""
    while node.op == "call_function" and returns_view(node.target) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.op == "placeholder"


# -- step 4: forward rewrite --------------------------------------------------------------------------
def _rewrite_forward(graph: Graph, fw: fx.GraphModule, n_fwd: int) -> list[tuple[str, Tensor]]:
    """Replace ``graph``'s body by the partitioned forward; return (saved name, fwd tensor) pairs."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    node_map: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    for node, handle in zip(placeholders, graph.inputs):
        fresh = new.placeholder(handle.node.name)
        fresh.meta.update(handle.node.meta)
        env[node] = node_map[handle.node] = fresh
    copy_fx_body(fw, new, env, graph.constant_data, graph.ir, replaces=graph.fx)
    _tag_traced_collectives(new)
    _reshape_views(new)
    outputs = _output_args(fw.graph)
    for handle, node in zip(graph.outputs, outputs[:n_fwd]):
        node_map.setdefault(handle.node, env[node])  # an input returned as it is is mapped already
    graph.replace_body(new, node_map)
    return [(node.name, _saved_tensor(graph, env[node])) for node in outputs[n_fwd:]]


def _tag_traced_collectives(fx_graph: fx.Graph) -> None:
    """Mark traced collectives (all-gathers, TP all-reduces) as the collectives they are (the
    passes and the replica plan find collectives by ``OP``); their arguments keep the order
    of the ops that built them."""
    for node in fx_graph.nodes:
        if node.target in (torch.ops.ipuxl.all_gather, torch.ops.ipuxl.all_gather.default):
            node.meta[OP] = "replicated_all_gather"
        elif node.target in tp_collectives.TP_ALL_REDUCE_TARGETS:
            node.meta[OP] = "replicated_all_reduce_TP"


def _reshape_views(fx_graph: fx.Graph) -> None:
    """Make traced ``view`` ops ``reshape`` ops.

    The trace ran on contiguous (fake) inputs, so torch decided every reshape could be a
    view (``aten.view``). A call site may pass a non-contiguous tensor (a slice of a
    transpose), where ``view`` fails; ``reshape`` is the same view when the strides
    allow one and a copy otherwise, which the graph's value semantics cannot tell apart.
    """
    for node in fx_graph.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default


def _saved_tensor(graph: Graph, node: fx.Node) -> Tensor:
    """The forward tensor of saved activation ``node``: an input or output, else a new output."""
    existing = graph.handle(node)
    if existing is not None:
        return existing
    tensor = graph.wrap(node)
    node.meta.setdefault(NAME, node.name)
    graph.add_output(tensor)
    return tensor


# -- step 5: grad graph -------------------------------------------------------------------------------
def _build_grad_graph(graph: Graph, bw: fx.GraphModule, provided: list[Tensor],
                      saved: list[tuple[str, Tensor]], required: list[Tensor]) -> Graph:
    grad = graph.ir.new_subgraph(f"{graph.base_name}_grad")
    placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    env: dict[fx.Node, fx.Node] = {}
    for k, t in enumerate(provided, start=1):
        handle = grad.add_input(t.spec, f"Gradient___{t.name}")
        if f"tangents_{k}" in placeholders:
            env[placeholders[f"tangents_{k}"]] = handle.node
    for name, t in saved:
        handle = grad.add_input(t.spec, t.name)
        env[placeholders[name]] = handle.node
    copy_fx_body(bw, grad.fx, env, grad.constant_data, graph.ir)
    _tag_traced_collectives(grad.fx)
    _reshape_views(grad.fx)
    outputs = []
    for node, fwd_input in zip(_output_args(bw.graph), required):
        out = env[node]
        if out.op != "placeholder":  # an input passed through keeps its own name
            out.meta[NAME] = f"Gradient___{fwd_input.name}"
        outputs.append(grad.wrap(out))
    grad.set_outputs(outputs)
    return grad
