"""popxl.addons' ``route_tensor``: ``is_subgraph`` (does one graph call another?).

Upstream's module also has ``route_tensor_into_graph``, which adds graph inputs to
every graph between a tensor's graph and a graph it calls and connects them at
the call sites already built. ipuxl does not provide it (call sites are not
re-wired after they are built); reading it raises ``AttributeError`` naming the
alternative: pass the tensor as a graph input (``inputs_dict``) when calling.
"""
from __future__ import annotations

from typing import Any

from ipuxl.errors import InvalidArgumentError
from ipuxl.ir import context
from ipuxl.ir.graph import Graph

__all__ = ["is_subgraph"]


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


def __getattr__(name: str) -> Any:
    if name == "route_tensor_into_graph":
        raise AttributeError(
            "popxl_addons.route_tensor.route_tensor_into_graph is not provided by ipuxl: it re-wires call sites "
            "that are already built; pass the tensor to the called graph as a graph input instead "
            "(popxl.graph_input in the graph, inputs_dict={input: tensor} at each call)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
