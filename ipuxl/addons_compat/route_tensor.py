"""popxl.addons' ``route_tensor``: ``is_subgraph`` (does one graph call another?) and
``route_tensor_into_graph`` (reach a parent graph's tensor from a graph it calls).

``route_tensor_into_graph(t, graph)`` gives ``graph`` an input for ``t`` and re-wires the
call sites already built: every graph on a call path from ``t``'s graph to ``graph`` gets
the input (once, however many paths pass through it), and each call or repeat of it in
those graphs passes the caller's own copy of ``t`` as that argument (a call site that
already passes it keeps its input). With ``modified=True`` the input is passed by
reference at every call site, so the callee's in-place updates reach ``t``. A repeat's
new input comes after its loop-carried ones: the same value every iteration.
"""
from __future__ import annotations

import torch.fx as fx

from ipuxl.errors import InvalidArgumentError, WrongGraphError
from ipuxl.ir import context
from ipuxl.ir.calls import call_nodes, callee_of
from ipuxl.ir.graph import Graph
from ipuxl.ir.tensor import Tensor
from ipuxl.ops.call import mark_by_ref

__all__ = ["is_subgraph", "route_tensor_into_graph"]


def is_subgraph(parent: Graph, subgraph: Graph) -> bool:
    """True when ``subgraph`` is ``parent`` or a graph ``parent`` calls, directly or
    through other called graphs (``ops.call``, ``ops.repeat``, either branch of
    ``ops.conditional``), as upstream's.

    Raises:
        InvalidArgumentError: (a TypeError) an argument is not a ``Graph``.

    Example:
        >>> with ir.main_graph:
        ...     ops.call(g)
        >>> is_subgraph(ir.main_graph, g), is_subgraph(g, ir.main_graph)
        (True, False)
    """
    for name, value in (("parent", parent), ("subgraph", subgraph)):
        if not isinstance(value, Graph):
            raise InvalidArgumentError(
                f"is_subgraph: {name} must be a Graph, got {type(value).__name__}", where=context.user_source_line(),
                fix="pass popxl Graphs (a GraphWithNamedArgs's is its .graph)")
    seen: set[Graph] = set()
    todo = [parent]
    while todo:
        graph = todo.pop()
        if graph is subgraph:
            return True
        if graph not in seen:
            seen.add(graph)
            todo.extend(graph.called_graphs)
    return False


def route_tensor_into_graph(tensor: Tensor, graph: Graph | None = None, modified: bool = False) -> Tensor:
    """``tensor`` as a tensor of ``graph`` (default: the graph being built), routed in as a new
    input through every graph between them (see the module docstring); ``tensor`` itself when
    it is in ``graph``.

    Raises:
        WrongGraphError: (a ValueError, as upstream's) ``graph`` is not called, directly or
            not, from ``tensor``'s graph, or a graph on the way is also called from a graph
            that cannot see ``tensor``.
        InvalidArgumentError: (a TypeError) ``tensor`` is not a Tensor or ``modified`` not a bool.

    Example:
        >>> with main:
        ...     a = popxl.variable(1)
        ...     ops.call(sg)
        >>> with sg:
        ...     a_in_sg = route_tensor_into_graph(a)  # sg's new input; the call passes a
    """
    graph = context.gcg() if graph is None else graph
    if not isinstance(tensor, Tensor) or not isinstance(modified, bool):
        raise InvalidArgumentError(
            f"route_tensor_into_graph takes a Tensor and modified=True/False, got {type(tensor).__name__} and "
            f"{modified!r}", where=context.user_source_line())
    if tensor.graph is graph:
        return tensor
    if not is_subgraph(tensor.graph, graph):
        raise WrongGraphError(
            f"{tensor.name!r} is not in the graph {graph.name}. Additionally, the tensor is not in a known parent "
            f"graph so cannot be moved into the graph ({tensor.graph.name} does not call {graph.name}, directly "
            "or not)", where=context.user_source_line(),
            fix="route a tensor of a graph that calls this one (build the call first), or pass it as an input")
    routed: dict[Graph, Tensor] = {tensor.graph: tensor}
    return _route(tensor, graph, routed, modified)


def _route(tensor: Tensor, graph: Graph, routed: dict[Graph, Tensor], modified: bool) -> Tensor:
    """``tensor`` in ``graph``: the input that carries it, made and connected on first need."""
    if graph in routed:
        return routed[graph]
    callers = [g for g in _graphs_reaching(tensor.graph, graph) if graph in g.called_graphs]
    sites = [(caller, node) for caller in callers for node in call_nodes(caller) if callee_of(node) is graph]
    others = [g for g in graph.ir.graphs if g not in callers and graph in g.called_graphs]
    if others:
        raise WrongGraphError(
            f"cannot route {tensor.name!r} into graph {graph.name}: it is also called from graph {others[0].name}, "
            f"which does not see the tensor", where=context.user_source_line(),
            fix="pass the tensor as an input at that call site, or route it from a graph above both")
    parents = {caller: _route(tensor, caller, routed, modified) for caller in callers}
    existing = {_passed_at(node, parents[caller]) for caller, node in sites}
    if len(existing) == 1 and None not in existing:  # every call site already passes it
        position = existing.pop()
        assert position is not None
        inner = graph.inputs[position]
    else:
        inner = graph.add_input(tensor.spec, tensor.name, by_ref=modified)
        for caller, node in sites:
            node.args = (*node.args, parents[caller].node)
    routed[graph] = inner
    if modified:
        for caller, node in sites:
            mark_by_ref(node, graph.inputs.index(inner), parents[caller])
    return inner


def _passed_at(node: fx.Node, parent: Tensor) -> int | None:
    """The argument position at which call ``node`` passes ``parent``, if it does."""
    return next((i for i, arg in enumerate(node.args) if arg is parent.node), None)


def _graphs_reaching(top: Graph, target: Graph) -> list[Graph]:
    """The graphs from which ``target`` is reached, ``top`` and those ``top`` calls."""
    reaching: list[Graph] = []
    seen: set[Graph] = set()
    todo = [top]
    while todo:
        graph = todo.pop()
        if graph in seen:
            continue
        seen.add(graph)
        if graph is not target and is_subgraph(graph, target):
            reaching.append(graph)
        todo.extend(graph.called_graphs)
    return reaching
