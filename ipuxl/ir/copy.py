"""Copying nodes between fx graphs: ``copy_node``, the one copier every pass uses.

``fx.Graph.node_copy`` maps a node's arguments through the function it is given but
copies ``meta`` shallowly, so the alias records (``ipuxl.ir.meta``: ``MODIFIES``,
``VIEW_OF``, ``WRITES``) of the copy would still name nodes of the graph it was
copied from. ``copy_node`` maps them through the same ``env`` as the arguments, so a
copy names only nodes of the graph it is in (``ir.verify`` checks that).

Example:
    >>> env = {x_old: x_new}
    >>> y_new = copy_node(y_old, new_graph, env)   # y_old = x_old.add_(1)
    >>> y_new.meta[MODIFIES] is x_new
    True
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.fx as fx

from ipuxl.ir.meta import BY_REF_ARGS, MODIFIES, VIEW_OF, WRITES

__all__ = ["copy_node", "remap_records", "node_records", "NODE_RECORDS", "Env"]

#: The meta keys whose values name nodes of the node's own graph: ``MODIFIES`` and
#: ``VIEW_OF`` one node, ``WRITES`` a list of nodes. A key added to ``ir.meta`` that
#: holds nodes belongs here, so copies remap it and the verifier checks it.
NODE_RECORDS = (MODIFIES, VIEW_OF, WRITES)
_LABELS = {MODIFIES: "MODIFIES", VIEW_OF: "VIEW_OF", WRITES: "WRITES"}  # as messages name them

#: Where a copy finds the new node of an old one: a mapping, or a function (which may
#: make the new node on first use, as the stage splitter makes stage inputs).
Env = Mapping[fx.Node, fx.Node] | Callable[[fx.Node], fx.Node]


def copy_node(node: fx.Node, into: fx.Graph, env: Env) -> fx.Node:
    """Copy ``node`` into ``into`` (at its insertion point), arguments and alias records mapped.

    Args:
        node: a node of another graph (or of ``into``, when ``env`` maps to new nodes).
        into: the fx graph that receives the copy.
        env: the new node of each node ``node`` reads or names in an alias record;
            arguments are mapped first (in argument order), then ``MODIFIES``,
            ``VIEW_OF`` and ``WRITES``.

    Returns:
        The copy. Its meta is a copy of ``node``'s: alias records name ``env``'s nodes,
        ``BY_REF_ARGS`` is a set of its own; other values are shared (meta tensors,
        the called ``Graph``, streams).

    Raises:
        KeyError: ``env`` (a mapping) has no new node for an argument or a record.
    """
    lookup = _lookup(env)
    new = into.node_copy(node, lookup)
    remap_records(new.meta, lookup)
    if BY_REF_ARGS in new.meta:
        new.meta[BY_REF_ARGS] = set(new.meta[BY_REF_ARGS])
    return new


def remap_records(meta: dict[str, Any], env: Env) -> None:
    """Make the alias records in ``meta`` name ``env``'s nodes, in place.

    A mapping that lacks a node raises ``KeyError``; a function decides itself (pass
    ``lambda n: replaced.get(n, n)`` to replace only some nodes).
    """
    lookup = _lookup(env)
    for key in (MODIFIES, VIEW_OF):
        if meta.get(key) is not None:
            meta[key] = lookup(meta[key])
    if WRITES in meta:
        meta[WRITES] = [lookup(w) for w in meta[WRITES]]


def node_records(node: fx.Node) -> list[tuple[str, fx.Node]]:
    """(key name, node) for every node ``node``'s alias records name, in ``NODE_RECORDS`` order."""
    found: list[tuple[str, fx.Node]] = []
    for key in (MODIFIES, VIEW_OF):
        if node.meta.get(key) is not None:
            found.append((_LABELS[key], node.meta[key]))
    found.extend((_LABELS[WRITES], w) for w in node.meta.get(WRITES, ()))
    return found


def _lookup(env: Env) -> Callable[[fx.Node], fx.Node]:
    if isinstance(env, Mapping):
        return env.__getitem__
    return env
