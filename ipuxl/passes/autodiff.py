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
   forward in the backward (docs/architecture.md, "Traps in torch.fx"). Views of
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

The pass is three modules: this one (the transform, gradient selection, called
graphs, the joint trace of step 1 and the order of the steps),
``autodiff_partition`` (steps 1b-5, on the joint graph) and ``autodiff_units``
(graphs made of calls, unit by unit).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Literal, Mapping, NoReturn, Sequence, cast, overload

import torch
import torch.fx as fx
from torch._functorch.partitioners import default_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ipuxl.dtypes import dtype_name
from ipuxl.errors import AutodiffError
from ipuxl.ir.aliases import written_nodes
from ipuxl.ir.call_op import CallEntry, zeros_in_layout
from ipuxl.ir.calls import call_nodes, callee, does_host_io, is_repeat, reachable_from, transfer_counts
from ipuxl.ir.context import user_source_line
from ipuxl.ir.grad_info import ExpectedConnectionType, GradGraphInfo
from ipuxl.ir.graph import Graph
from ipuxl.ir.lower import compiled_callee, graph_callable, lower_graph
from ipuxl.ir.meta import COLLECTIVE_OPS, NO_GRAD, OP, SOURCE
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels.custom_ops import custom_op_error, route_custom_ops
from ipuxl.passes.autodiff_partition import BWD_TAG as BWD_TAG, FWD_TAG as FWD_TAG  # importable from here too
from ipuxl.passes.autodiff_partition import (build_grad_graph, check_gradient_paths, recompute_input_views,
                                             rewrite_forward, tag_forward)
from ipuxl.passes.autodiff_units import MAX_OP_SEGMENTS as MAX_OP_SEGMENTS, MIN_CALL_UNITS as MIN_CALL_UNITS
from ipuxl.passes.autodiff_units import Unit as Unit, differentiate_units

__all__ = ["autodiff", "differentiate"]


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
        called_graphs_grad_info: ``{called graph: its GradGraphInfo}``. A graph marked
            unsafe to differentiate recursively (``Graph.can_be_recursively_autodiffed``
            False: a popxl.addons Module's ``build_grad`` graph) must be listed when
            ``graph`` calls it, as PopART requires. Otherwise not used: each graph
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
            floating-point input; or ``graph`` calls a graph marked unsafe to
            differentiate recursively that ``called_graphs_grad_info`` lacks. Checked
            before anything is traced.
    """
    _refuse_collectives(graph)
    _refuse_remote_ops(graph)
    _refuse_unsafe_calls(graph, called_graphs_grad_info or {})
    provided = list(grads_provided) if grads_provided is not None else None
    required = list(grads_required) if grads_required is not None else None
    info = differentiate(graph, provided, required)
    if not return_all_grad_graphs:
        return info
    return {graph: info, **_differentiated_callees(graph)}


#: Collectives with a gradient rule (``replicated_all_gather``: a replicated slice, as in PopXL;
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
    info = differentiate_units(graph, provided, required, explicit, lambda g: callees.entry(g) is not None)
    if info is None:
        info = _differentiate_traced(graph, provided, required, explicit, callees)
    graph.grad_info = info
    return info


def _differentiate_traced(graph: Graph, provided: list[Tensor], required: list[Tensor], explicit: bool,
                          callees: "_CalledGraphs") -> GradGraphInfo:
    """Steps 1-5 of the module docstring."""
    # the joint and partitioned graph modules are read, never run: fx generates their code only if run
    with _use_lazy_graph_module(True):
        joint = _trace_joint(graph, provided, required, callees)
        n_fwd = len(graph.outputs)
        check_gradient_paths(graph, joint, n_fwd, required, explicit)
        tag_forward(joint, n_fwd)
        recompute_input_views(joint)
        fw, bw = default_partition(joint, None, num_fwd_outputs=n_fwd)
    saved = rewrite_forward(graph, fw, n_fwd)
    grad_graph = build_grad_graph(graph, bw, provided, saved, required)
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
            cache[g] = compiled_callee(g, entry if entry is not None else
                                       route_custom_ops(lower_graph(g, callee_fn)).forward)
        return cache[g]

    return compiled_callee(graph, route_custom_ops(lower_graph(graph, callee_fn)).forward)


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
    ins = ([t for t in graph.inputs if t.dtype.is_floating_point and not t.node.meta.get(NO_GRAD)]
           if required is None else list(required))
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

    # Example inputs in the layouts they have where the graph runs (a segment's input may be a
    # transpose), made as fake tensors: real ones would allocate every weight's size again.
    # make_fx traces in the fake mode it finds on its inputs; constants (and variables read
    # by the graph) are real tensors of the lowered module.
    fake = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True, shape_env=ShapeEnv(),
                          static_shapes=True)
    with fake:
        primals = [zeros_in_layout(t.node) if isinstance(t.node.meta.get("val"), torch.Tensor)
                   else torch.zeros(t.shape, dtype=t.spec.dtype) for t in graph.inputs]
        tangents = [torch.zeros(t.shape, dtype=t.spec.dtype) for t in provided]
    try:
        return make_fx(joint, tracing_mode="fake", _allow_non_fake_inputs=True)(primals, tangents)
    except RuntimeError as exc:
        refused = custom_op_error(exc, lambda op: next(
            (n.meta.get(SOURCE) for g in reachable_from([graph]) for n in g.fx.nodes if n.target is op), None))
        if refused is None:
            raise
        raise refused from exc


def _index(tensors: Sequence[Tensor], t: Tensor) -> int:
    return next(i for i, m in enumerate(tensors) if m is t)


def _refuse_unsafe_calls(graph: Graph, called_graphs_grad_info: Mapping[Graph, GradGraphInfo]) -> None:
    """Refuse to differentiate through a called graph marked unsafe to autodiff recursively."""
    for called in reachable_from([graph])[1:]:
        if not called.can_be_recursively_autodiffed and called not in called_graphs_grad_info:
            raise AutodiffError(
                f"graph '{graph.name}' calls graph '{called.name}', which is marked as unsafe to autodiff "
                "recursively (its gradient is written by hand): autodiff cannot differentiate through it",
                where=user_source_line(),
                fix="pass its gradient graph in called_graphs_grad_info={called_graph: grad_graph_info}")
