"""The IR's invariants, checked: ``verify_graph`` and ``verify_ir``.

Passes rewrite graphs; these functions say, after a pass, whether what it left is
still a well-formed IR, and if not, what is broken and where. Pass tests call
``verify_ir`` after each pass. What is checked, per graph:

1. the fx graph is well formed (``fx.Graph.lint``: every argument defined before
   use, in this graph) and its placeholders lead it;
2. ``inputs`` are placeholders of this graph with the role ``Role.INPUT``, each
   once, and every such placeholder is an input; outputs and every Tensor handle
   belong to this graph and stand for nodes still in it;
3. every node carries its value's spec (``meta["val"]``);
4. alias records (``ir.copy.NODE_RECORDS``: ``MODIFIES``, ``VIEW_OF``, ``WRITES``)
   name nodes of this graph, not of the graph a node was copied from (copy nodes
   with ``ir.copy.copy_node``, which remaps them);
5. calls and repeats call a graph of the same IR with one argument per callee
   input; by-reference positions and ``getitem`` indices are in range;
6. a differentiated graph's ``grad_info`` describes this graph.

Example:
    >>> verify_ir(ir)  # raises PassError naming the graph, the node and the problem
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, NoReturn

import torch.fx as fx

from ipuxl.errors import PassError
from ipuxl.ir.calls import callee
from ipuxl.ir.copy import node_records
from ipuxl.ir.meta import BY_REF_ARGS, CALLED_GRAPH, ROLE, Role

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir

__all__ = ["verify_graph", "verify_ir"]

_FIX = "a pass left the IR inconsistent: fix the pass that ran last (see its docstring's preconditions)"


def verify_ir(ir: "Ir") -> None:
    """Check every graph of ``ir`` (see the module docstring).

    Raises:
        PassError: an invariant is broken; the message names the graph and node.
    """
    if ir.main_graph not in ir.graphs:
        _fail(ir.main_graph, "the main graph is not in ir.graphs")
    for graph in ir.graphs:
        if graph.ir is not ir:
            _fail(graph, f"it is listed in an IR it does not belong to ({graph.ir!r})")
        verify_graph(graph)


def verify_graph(graph: "Graph") -> None:
    """Check one graph (see the module docstring).

    Raises:
        PassError: an invariant is broken; the message names the graph and node.
    """
    try:
        graph.fx.lint()
    except RuntimeError as exc:  # fx's own message says which node and why
        _fail(graph, f"the fx graph is malformed: {exc}")
    nodes = set(graph.fx.nodes)
    _check_placeholders(graph)
    _check_handles(graph, nodes)
    for node in graph.fx.nodes:
        _check_node(graph, node, nodes)
    _check_grad_info(graph)


def _check_placeholders(graph: "Graph") -> None:
    """Placeholders lead the graph; the inputs are exactly its ``Role.INPUT`` placeholders."""
    seen_op = None
    for node in graph.fx.nodes:
        if node.op != "placeholder":
            seen_op = seen_op or node
        elif seen_op is not None:
            _fail(graph, f"placeholder '{node.name}' comes after op '{seen_op.name}': placeholders lead the graph",
                  node)
    inputs = [t.node for t in graph.inputs]
    if len(set(inputs)) != len(inputs):
        _fail(graph, f"an input appears twice: {[n.name for n in inputs]}")
    for node in inputs:
        if node.op != "placeholder" or node.meta.get(ROLE) != Role.INPUT:
            _fail(graph, f"input '{node.name}' is a {node.op} with role {node.meta.get(ROLE)!r}, not a "
                         f"placeholder with role {Role.INPUT!r}", node)
    for node in graph.fx.nodes:
        if node.op == "placeholder" and node.meta.get(ROLE) == Role.INPUT and node not in inputs:
            _fail(graph, f"placeholder '{node.name}' has role {Role.INPUT!r} but is not in graph.inputs", node)


def _check_handles(graph: "Graph", nodes: set[fx.Node]) -> None:
    """Inputs, outputs and every handle belong to ``graph`` and stand for nodes in it."""
    for kind, tensors in (("input", graph.inputs), ("output", graph.outputs)):
        for i, t in enumerate(tensors):
            if t.graph is not graph:
                _fail(graph, f"{kind} {i} ('{t.name}') is a tensor of graph '{t.graph.name}'")
            if t.node not in nodes:
                _fail(graph, f"{kind} {i} ('{t.name}') stands for node '{t.node.name}', which is not in the graph")
            if graph.handle(t.node) is not t:
                _fail(graph, f"{kind} {i} ('{t.name}') is not the handle graph.wrap gives for its node", t.node)
    for node, handle in graph.handles().items():
        if handle.node is not node or handle.graph is not graph:
            _fail(graph, f"the handle of node '{node.name}' stands for '{handle.node.name}' of graph "
                         f"'{handle.graph.name}'", node)
        if node not in nodes:
            _fail(graph, f"tensor '{handle.name}' stands for node '{node.name}', which is not in the graph")


def _check_node(graph: "Graph", node: fx.Node, nodes: set[fx.Node]) -> None:
    if node.op == "output":
        return
    if "val" not in node.meta:
        _fail(graph, f"node '{node.name}' has no meta['val'] (its shape and dtype)", node)
    for key, target in node_records(node):
        if target not in nodes:
            _fail(graph, f"node '{node.name}' records {key} of '{getattr(target, 'name', target)}', which is not "
                         f"a node of this graph{_owner(graph, target)}", node,
                  fix="copy nodes between graphs with ipuxl.ir.copy.copy_node, which remaps alias records")
    called = callee(node)
    if called is not None:
        _check_call(graph, node, called)
    elif node.op == "call_function" and node.target is operator.getitem:
        _check_getitem(graph, node)


def _check_call(graph: "Graph", node: fx.Node, called: "Graph") -> None:
    if called not in graph.ir.graphs:
        _fail(graph, f"node '{node.name}' calls graph '{called.name}', which is not in this IR", node)
    if node.meta.get(CALLED_GRAPH, called) is not called:
        _fail(graph, f"node '{node.name}' calls '{called.name}' but records calling "
                     f"'{node.meta[CALLED_GRAPH].name}'", node)
    if len(node.args) != len(called.inputs):
        _fail(graph, f"node '{node.name}' passes {len(node.args)} arguments to graph '{called.name}', which has "
                     f"{len(called.inputs)} inputs", node)
    bad = [i for i in node.meta.get(BY_REF_ARGS, ()) if not 0 <= i < len(node.args)]
    if bad:
        _fail(graph, f"node '{node.name}' passes arguments {bad} by reference, out of its {len(node.args)}", node)


def _check_getitem(graph: "Graph", node: fx.Node) -> None:
    source, index = node.args[0], node.args[1]
    if not isinstance(source, fx.Node):
        return
    called = callee(source)
    count = len(called.outputs) if called is not None else _result_count(source)
    if count is not None and isinstance(index, int) and not -count <= index < count:
        _fail(graph, f"node '{node.name}' reads result {index} of '{source.name}', which has {count}", node)


def _result_count(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return len(val) if isinstance(val, (tuple, list)) else None


def _check_grad_info(graph: "Graph") -> None:
    info = graph.grad_info
    if info is None:
        return
    if info.forward_graph is not graph:
        _fail(graph, f"its grad_info differentiates graph '{info.forward_graph.name}'")
    if info.graph.ir is not graph.ir:
        _fail(graph, f"its grad graph '{info.graph.name}' belongs to another IR")
    for c in (*info.expected_inputs, *info.expected_outputs):
        if c.fwd_tensor.graph is not graph:
            _fail(graph, f"its grad_info connects tensor '{c.fwd_tensor.name}' of graph "
                         f"'{c.fwd_tensor.graph.name}'")


def _owner(graph: "Graph", target: Any) -> str:
    """Where a node named by a record lives, when that is another graph of the IR."""
    owner = getattr(target, "graph", None)
    for g in graph.ir.graphs:
        if g is not graph and g.fx is owner:
            return f" but of graph '{g.name}'"
    return ""


def _fail(graph: "Graph", problem: str, node: fx.Node | None = None, fix: str = _FIX) -> NoReturn:
    where = f"graph '{graph.name}'" + (f", node '{node.name}'" if node is not None else "")
    raise PassError(f"IR check failed: graph '{graph.name}': {problem}", where=where, fix=fix)
