"""Automatic differentiation of an IR graph with PyTorch's own machinery.

Preconditions: ``graph`` is a subgraph (not the main graph) without host transfers.

Algorithm:

1. Lower the forward graph to a callable and trace the *joint* function
   ``(primals, tangents) -> (all forward outputs, grads of grads_required)`` with
   ``make_fx`` over ``torch.func.vjp`` (fake tensors: no data is computed).
2. Tag every joint node forward (an ancestor of a forward output) or backward, so
   functorch's ``default_partition`` splits there instead of recomputing the
   forward in the backward (see the DESIGN note on ``partitioner_tag``).
3. Partition into forward-with-saved-activations and backward graphs.
4. Rewrite the forward IR graph with the partitioned forward: its inputs and
   existing outputs keep their positions; activations the backward needs become
   new outputs (unless they already are inputs or outputs), as in PopXL.
5. Build the grad IR graph: inputs are the gradients of ``grads_provided`` (in
   order) then the activations; outputs are the gradients of ``grads_required``.

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
from typing import Any, NoReturn, Sequence

import torch
import torch.fx as fx
from torch._functorch.partitioners import default_partition
from torch.fx.experimental.proxy_tensor import make_fx

from ipuxl.dtypes import dtype_name
from ipuxl.errors import AutodiffError
from ipuxl.ir.call_op import CallEntry
from ipuxl.ir.context import user_source_line
from ipuxl.ir.fx_import import copy_fx_body
from ipuxl.ir.graph import Graph
from ipuxl.ir.calls import CallTarget, RepeatTarget
from ipuxl.ir.lower import compiled_callee, graph_callable, lower_graph
from ipuxl.ir.tensor import Tensor, TensorSpec

__all__ = ["differentiate"]

FWD_TAG, BWD_TAG = "is_forward", "is_backward"


def differentiate(graph: Graph, grads_provided: Sequence[Tensor] | None, grads_required: Sequence[Tensor] | None,
                  *, check_paths: bool = True) -> tuple[Graph, list[tuple[Tensor, str]], list[Tensor]]:
    """Differentiate ``graph`` (see the module docstring).

    Returns:
        ``(grad_graph, expected_inputs, expected_outputs)`` where ``expected_inputs``
        holds ``(forward tensor, "FwdGrad" | "Fwd")`` per grad-graph input and
        ``expected_outputs`` the forward input of each grad-graph output.
    """
    provided, required = _select(graph, grads_provided, grads_required)
    callees = _CalledGraphs(graph)  # holds the call entries until the trace is imported
    explicit = grads_required is not None and check_paths
    by_units = _differentiate_units(graph, provided, required, explicit, callees)
    if by_units is not None:
        graph._ipuxl_grad = by_units
        return by_units
    joint = _trace_joint(graph, provided, required, callees)
    n_fwd = len(graph.outputs)
    _check_paths(graph, joint, n_fwd, required, explicit)
    _tag_forward(joint, n_fwd)
    fw, bw = default_partition(joint, None, num_fwd_outputs=n_fwd)
    saved = _rewrite_forward(graph, fw, n_fwd)
    grad_graph = _build_grad_graph(graph, bw, provided, saved, required)
    expected_inputs = [(t, "FwdGrad") for t in provided] + [(t, "Fwd") for _, t in saved]
    graph._ipuxl_grad = (grad_graph, expected_inputs, required)
    return grad_graph, expected_inputs, required


def differentiated_callees(graph: Graph) -> list[Graph]:
    """Graphs called (at any depth) from ``graph`` that autodiff differentiated in place."""
    found: list[Graph] = []
    stack, seen = [graph], {graph}
    while stack:
        for node in stack.pop().fx.nodes:
            callee = getattr(node.target, "graph", None) if isinstance(node.target, CallTarget) else None
            if callee is not None and callee not in seen:
                seen.add(callee)
                stack.append(callee)
                if getattr(callee, "_ipuxl_grad", None) is not None:
                    found.append(callee)
    return found


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
        if callee in self._loop_bodies or getattr(callee, "_ipuxl_grad", None) is not None:
            return False
        if any(callee.is_input_modified(t) for t in callee.inputs):
            return False
        if any(n.meta.get("ipuxl_role") in ("h2d", "d2h") for n in callee.fx.nodes):
            return False
        return (any(t.dtype.is_floating_point for t in callee.inputs)
                and any(t.dtype.is_floating_point for t in callee.outputs))

    def _prepare(self, callee: Graph) -> CallEntry:
        grad_graph, expected, required = differentiate(callee, None, None)
        inputs = {id(t): i for i, t in enumerate(callee.inputs)}
        outputs = {id(t): i for i, t in enumerate(callee.outputs)}
        grad_entry = CallEntry(grad_graph.name, [t.spec for t in grad_graph.outputs], graph=grad_graph,
                               run=_eager(grad_graph))
        self._entries[grad_graph] = grad_entry  # kept alive with the forward entry

        def backward(args: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                     grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
            grad_args = []
            for t, kind in expected:
                if kind == "FwdGrad":
                    g = grads[outputs[id(t)]]
                    grad_args.append(torch.zeros(t.shape, dtype=t.dtype, device=args[0].device) if g is None else g)
                else:
                    grad_args.append(args[inputs[id(t)]] if id(t) in inputs else outs[outputs[id(t)]])
            result: list[torch.Tensor | None] = [None] * len(args)
            for t, g in zip(required, grad_entry(*grad_args)):
                result[inputs[id(t)]] = g
            return result

        return CallEntry(callee.name, [t.spec for t in callee.outputs], graph=callee, backward=backward,
                         run=_eager(callee))


def _loop_bodies(graph: Graph) -> set[Graph]:
    """Graphs run by ``ops.repeat`` anywhere below ``graph`` (their outputs feed their inputs)."""
    bodies: set[Graph] = set()
    stack, seen = [graph], {graph}
    while stack:
        for node in stack.pop().fx.nodes:
            if isinstance(node.target, CallTarget):
                if isinstance(node.target, RepeatTarget):
                    bodies.add(node.target.graph)
                if node.target.graph not in seen:
                    seen.add(node.target.graph)
                    stack.append(node.target.graph)
    return bodies


def _eager(graph: Graph) -> Any:
    return lambda *args: graph_callable(graph)(*args)


def _forward_callable(graph: Graph, callees: _CalledGraphs) -> Any:
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
    if any(n.meta.get("ipuxl_role") in ("h2d", "d2h") for n in graph.fx.nodes):
        raise AutodiffError(f"graph '{graph.name}' contains host transfers and cannot be differentiated")
    outs = list(graph.outputs) if provided is None else list(provided)
    ins = [t for t in graph.inputs if t.dtype.is_floating_point] if required is None else list(required)
    for t in outs:
        _require_member(t, graph.outputs, graph, "grads_provided", "an output")
    for t in ins:
        _require_member(t, graph.inputs, graph, "grads_required", "an input")
        if not t.dtype.is_floating_point:
            raise AutodiffError(f"autodiff of graph '{graph.name}': input '{t.name}' has dtype {t.dtype}, "
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


def _differentiate_units(graph: Graph, provided: list[Tensor], required: list[Tensor], explicit: bool,
                         callees: _CalledGraphs) -> tuple | None:
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
    if any(n.meta.get("ipuxl_writes") or "ipuxl_modifies" in n.meta for n in nodes):
        return None

    def is_unit_call(node: fx.Node) -> bool:
        return (node.op == "call_function" and isinstance(node.target, CallTarget)
                and not isinstance(node.target, RepeatTarget) and not node.meta.get("ipuxl_by_ref_args")
                and callees.entry(node.target.graph) is not None)

    # what the gradients flow through: from the required inputs, to the provided outputs
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
    on_path = needs_grad & feeds_output
    # Units in program order. Ops off the gradient path (seeds, masks, metrics) stay in the
    # forward as they are, moved ahead of an open run when they do not read it (all ops
    # here are pure), so that they do not split runs.
    units: list[tuple[str, Any]] = []
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
        if node.target is operator.getitem and is_unit_call(node.args[0]):
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
    if (sum(kind == "call" for kind, _ in units) < MIN_CALL_UNITS
            or sum(kind == "ops" for kind, _ in units) > MAX_OP_SEGMENTS):
        return None
    infos = _rebuild_as_calls(graph, units, on_path, {t.node for t in provided})
    return _grad_by_units(graph, infos, provided, required, explicit)


def _rebuild_as_calls(graph: Graph, units: list[tuple[str, Any]], on_path: set[fx.Node],
                      provided: set[fx.Node]) -> list[Any]:
    """Replace ``graph``'s body by one call per unit (segments become graphs); return the
    call sites, in program order."""
    from ipuxl.ops.call import call_with_info  # ops depend on the IR; import late

    returned = {t.node for t in graph.outputs}
    plans = []
    for kind, unit in units:
        if kind == "ops":
            plans.append(("ops", _segment_graph(graph, unit, returned, on_path, provided)))
        else:
            plans.append((kind, unit))
    old_outputs = list(graph.outputs)
    old_fx, new = graph.fx, fx.Graph()
    env: dict[fx.Node, Tensor] = {}
    handles: dict[fx.Node, Tensor] = {}
    for node in old_fx.nodes:
        if node.op == "placeholder":
            fresh = new.placeholder(node.target)
            fresh.meta.update(node.meta)
            handle = graph._handles[node]
            handle._node = fresh
            handles[fresh] = handle
            env[node] = handle
    graph.fx, graph._handles = new, handles

    def value(node: fx.Node) -> Tensor:
        if node not in env and node.op == "get_attr":  # a constant passed to a call
            fresh = new.get_attr(node.target)
            fresh.meta.update(node.meta)
            env[node] = graph.wrap(fresh)
        return env[node]

    infos = []
    with graph:
        for kind, plan in plans:
            if kind == "free":  # an op off the gradient path, copied as it is
                fresh = new.node_copy(plan, lambda n: value(n).node)
                if "ipuxl_view_of" in plan.meta:
                    fresh.meta["ipuxl_view_of"] = value(plan.meta["ipuxl_view_of"]).node
                env[plan] = graph.wrap(fresh)
                continue
            if kind == "ops":
                sub, ins, outs = plan
                info = call_with_info(sub, *[value(n) for n in ins])
                for node, out in zip(outs, info.outputs):
                    env[node] = out
            else:
                info = call_with_info(plan.target.graph, *[value(a) for a in plan.args])
                for user in plan.users:
                    env[user] = info.outputs[user.args[1]]
            infos.append(info)
    for i, handle in enumerate(old_outputs):  # the caller's output handles stay valid
        if handle.node.op == "placeholder" or handle.node in handles:
            continue
        node = value(handle.node).node
        handle._node = node
        graph._handles[node] = handle
    return infos


def _segment_graph(graph: Graph, nodes: list[fx.Node], returned: set[fx.Node], on_path: set[fx.Node],
                   provided_nodes: set[fx.Node]) -> tuple[Graph, list, list]:
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
    env: dict[fx.Node, fx.Node] = {}
    for node in ins:
        val = node.meta["val"]
        env[node] = sub.add_input(TensorSpec(tuple(val.shape), val.dtype),
                                   node.meta.get("ipuxl_name", node.name)).node
    for node in nodes:
        for a in node.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = sub.fx.get_attr(a.target)
                env[a].meta.update(a.meta)
                sub.constants[a.target] = graph.constants[a.target]
        copied = sub.fx.node_copy(node, lambda n: env[n])
        view_of = node.meta.get("ipuxl_view_of")
        if view_of is not None:
            copied.meta["ipuxl_view_of"] = env.get(view_of, copied.all_input_nodes[0] if copied.all_input_nodes
                                                    else None)
        env[node] = copied
    sub.set_outputs([sub.wrap(env[n]) for n in outs])
    provided = [t for t, n in zip(sub.outputs, outs) if t.dtype.is_floating_point and (
        n in provided_nodes or (n in on_path and any(u not in inside and u in on_path for u in n.users)))]
    required = [t for t, n in zip(sub.inputs, ins) if n in on_path and t.dtype.is_floating_point]
    if provided and required:
        differentiate(sub, provided, required, check_paths=False)
    return sub, ins, outs


def _grad_by_units(graph: Graph, infos: list[Any], provided: list[Tensor], required: list[Tensor],
                   explicit: bool) -> tuple:
    from ipuxl.ops.call import call  # ops depend on the IR; import late

    grad = graph.ir.new_subgraph(f"{graph.base_name}_grad")
    sums: dict[fx.Node, Tensor] = {}  # forward node -> its gradient so far
    saved: dict[fx.Node, Tensor] = {}  # forward node -> grad-graph input holding it
    saved_fwd: list[Tensor] = []

    def add_grad(node: fx.Node, g: Tensor) -> None:
        sums[node] = g if node not in sums else sums[node] + g

    visible = {id(t) for t in (*graph.inputs, *graph.outputs)}

    def forward_value(t: Tensor) -> Tensor:
        """The grad-graph input holding forward tensor ``t`` (made a forward output if needed)."""
        if t.node not in saved:
            fwd = graph.wrap(t.node)
            if id(fwd) not in visible:
                graph.add_output(fwd)
                visible.add(id(fwd))
            saved[t.node] = grad.add_input(fwd.spec, fwd.name)
            saved_fwd.append(fwd)
        return saved[t.node]

    with grad:
        for t in provided:
            add_grad(t.node, grad.add_input(t.spec, f"Gradient___{t.name}"))
        for info in reversed(infos):
            grad_info = getattr(info.called_graph, "_ipuxl_grad", None)
            if grad_info is None:
                continue
            callee_grad, expected, callee_required = grad_info
            parents = [info.graph_to_parent(t) for t, _ in expected]
            if not any(kind == "FwdGrad" and p.node in sums for (_, kind), p in zip(expected, parents)):
                continue  # nothing downstream needs this unit's gradients
            args = []
            for (t, kind), parent in zip(expected, parents):
                if kind == "FwdGrad":
                    args.append(sums[parent.node] if parent.node in sums else _zeros(t))
                else:
                    args.append(forward_value(parent))
            for t, g in zip(callee_required, call(callee_grad, *args)):
                add_grad(info.graph_to_parent(t).node, g)
        outputs = []
        for t in required:
            g = sums.get(t.node)
            if g is None:
                if explicit:
                    raise AutodiffError(
                        f"autodiff of graph '{graph.name}': input '{t.name}' has no differentiable path to the "
                        "outputs in grads_provided (its gradient would always be zero)", where=user_source_line(),
                        fix="remove it from grads_required, or check that the outputs use it")
                g = _zeros(t)
            if g.node.op != "placeholder":
                g.node.meta["ipuxl_name"] = f"Gradient___{t.name}"
            outputs.append(g)
    grad.set_outputs(outputs)
    expected_inputs = [(t, "FwdGrad") for t in provided] + [(t, "Fwd") for t in saved_fwd]
    return grad, expected_inputs, required


def _zeros(like: Tensor) -> Tensor:
    from ipuxl.ir.build import emit

    shape, dtype = list(like.shape), like.dtype
    return emit("zeros", torch.ops.aten.zeros.default, (shape,), {"dtype": dtype, "device": torch.device("cpu")},
                meta_fn=lambda *a, **k: torch.empty(shape, dtype=dtype, device="meta"))


# -- step 1: joint trace ----------------------------------------------------------------------
def _trace_joint(graph: Graph, provided: list[Tensor], required: list[Tensor],
                 callees: _CalledGraphs) -> fx.GraphModule:
    forward = _forward_callable(graph, callees)
    outs_idx = [_index(graph.outputs, t) for t in provided]
    req_idx = [_index(graph.inputs, t) for t in required]
    # Inputs the graph updates in place are copied, as a by-value call does.
    written = {w for n in graph.fx.nodes for w in n.meta.get("ipuxl_writes", ())}
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

        _, vjp_fn, all_outs = torch.func.vjp(f, *[primals[i] for i in req_idx], has_aux=True)
        grads = vjp_fn(tuple(tangents)) if req_idx else ()
        return (*all_outs, *grads)

    primals = [torch.zeros(t.shape, dtype=t.dtype) for t in graph.inputs]
    tangents = [torch.zeros(t.shape, dtype=t.dtype) for t in provided]
    return make_fx(joint, tracing_mode="fake")(primals, tangents)


def _index(tensors: Sequence[Tensor], t: Tensor) -> int:
    return next(i for i, m in enumerate(tensors) if m is t)


def _check_paths(graph: Graph, joint: fx.GraphModule, n_fwd: int, required: list[Tensor], explicit: bool) -> None:
    """Raise when an explicitly required gradient does not depend on any provided gradient."""
    if not explicit:
        return
    grads = list(joint.graph.output_node().args[0][n_fwd:])
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
    stack = [n for n in joint.graph.output_node().args[0][:n_fwd] if isinstance(n, fx.Node)]
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


# -- step 4: forward rewrite --------------------------------------------------------------------------
def _rewrite_forward(graph: Graph, fw: fx.GraphModule, n_fwd: int) -> list[tuple[str, Tensor]]:
    """Replace ``graph``'s body by the partitioned forward; return (saved name, fwd tensor) pairs."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    handles: dict[fx.Node, Tensor] = {}
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    for node, handle in zip(placeholders, graph.inputs):
        fresh = new.placeholder(handle.node.name)
        fresh.meta.update(handle.node.meta)
        env[node] = fresh
        handle._node = fresh
        handles[fresh] = handle
    copy_fx_body(fw, new, env, graph.constants, graph.ir, replaces=graph.fx)
    outputs = list(fw.graph.output_node().args[0])
    graph.fx = new
    graph._handles = handles
    for handle, node in zip(graph.outputs, outputs[:n_fwd]):
        _rebind(graph, handle, env[node])
    saved: list[tuple[str, Tensor]] = []
    for node in outputs[n_fwd:]:
        saved.append((node.name, _saved_tensor(graph, env[node])))
    return saved


def _rebind(graph: Graph, handle: Tensor, node: fx.Node) -> None:
    if node in graph._handles:
        index = _index(graph.outputs, handle)
        graph._outputs[index] = graph._handles[node]
        return
    handle._node = node
    graph._handles[node] = handle


def _saved_tensor(graph: Graph, node: fx.Node) -> Tensor:
    existing = graph._handles.get(node)
    if existing is not None:
        return existing
    tensor = graph.wrap(node)
    node.meta.setdefault("ipuxl_name", node.name)
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
    copy_fx_body(bw, grad.fx, env, grad.constants, graph.ir)
    outputs = []
    for node, fwd_input in zip(bw.graph.output_node().args[0], required):
        out = env[node]
        if out.op != "placeholder":  # an input passed through keeps its own name
            out.meta["ipuxl_name"] = f"Gradient___{fwd_input.name}"
        outputs.append(grad.wrap(out))
    grad.set_outputs(outputs)
    return grad

