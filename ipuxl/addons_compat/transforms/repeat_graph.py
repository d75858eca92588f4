"""popxl.addons' ``repeat_graph``: wrap a graph's ops in a device loop, in place.

Every op of the graph moves into a new graph that the old one then runs
``repeat_count`` times with ``ops.repeat``. What the ops read from outside (the
graph's inputs, variables, constants) becomes inputs of the new graph passed by
reference, so in-place updates reach them; the host-transfer slots move with their
ops, so each iteration loads and stores the next slice of its streams.
"""
from __future__ import annotations

import torch.fx as fx

from ipuxl.errors import InvalidArgumentError
from ipuxl.ir import context
from ipuxl.ir.copy import copy_node
from ipuxl.ir.graph import Graph
from ipuxl.ir.meta import ROLE, Role
from ipuxl.ir.tensor import Tensor
from ipuxl.ops.call import repeat

__all__ = ["repeat_graph"]


def repeat_graph(graph: Graph, repeat_count: int) -> Graph:
    """Move ``graph``'s ops into a new graph called ``repeat_count`` times from ``graph``.

    ``graph`` may be the main graph. With ``repeat_count <= 1`` nothing changes and
    ``graph`` is returned (as upstream). Tensor handles of the moved ops are dropped.

    Steps: 1. copy each op into the new graph, the tensors it reads from outside
    becoming by-reference inputs and its host-transfer slots moving with it; 2. rebuild
    ``graph`` as its inputs and variables plus one ``ops.repeat`` of the new graph.

    Returns:
        The new graph (the loop body).

    Raises:
        InvalidArgumentError: ``graph`` has outputs (they would be left without ops).
    """
    if repeat_count <= 1:
        return graph
    if graph.outputs:
        raise InvalidArgumentError(
            f"repeat_graph: graph '{graph.name}' has outputs {[t.name for t in graph.outputs]}, which would be left "
            "without the ops computing them", where=context.user_source_line(),
            fix="repeat a graph without outputs (the main graph, or a step graph storing its results)")
    body = graph.ir.create_empty_graph("repeat_graph")
    outside = _copy_into(graph, body)
    new_fx = fx.Graph()
    node_map = {node: copy_node(node, new_fx, {}) for node in outside.values()}  # leaves: nothing to map
    with graph.rebuild(new_fx, node_map), graph:
        repeat(body, repeat_count, inputs_dict={inp: graph.wrap(node_map[node]) for inp, node in outside.items()})
    return body


def _copy_into(graph: Graph, body: Graph) -> dict[Tensor, fx.Node]:
    """Copy ``graph``'s ops into ``body``; returns body input -> the outside node it stands for."""
    env: dict[fx.Node, fx.Node] = {}
    outside: dict[Tensor, fx.Node] = {}
    for node in list(graph.fx.nodes):
        if node.op == "output":
            continue
        tensor = graph.wrap(node) if node.op in ("placeholder", "get_attr") else None
        if tensor is not None and (node.op == "get_attr" or node.meta.get(ROLE, Role.INPUT) == Role.INPUT):
            inp = body.add_input(tensor.spec, tensor.name, by_ref=True)
            env[node], outside[inp] = inp.node, node
        elif tensor is not None:  # a slot the device fills (host_store): it moves with its op
            slot = body.add_input(tensor.spec, tensor.name, role=node.meta[ROLE])
            for key, value in node.meta.items():
                slot.node.meta.setdefault(key, value)
            env[node] = slot.node
        else:
            env[node] = copy_node(node, body.fx, env)
    return outside
