"""The alias model: which node owns the storage a tensor lives in, and what ops write.

ipuxl records aliasing on the nodes themselves (keys in ``ipuxl.ir.meta``):

* an in-place op's result *is* the tensor it wrote: ``MODIFIES`` points at it;
* a view (reshape, slicing, transpose, a same-dtype ``.to``...) shares its input's
  storage: ``VIEW_OF`` points at the input;
* an op that writes in place lists what it writes in ``WRITES``: the *in-place roots*
  of the written tensors (``storage_owner(node, views=False)``), so writes through a
  chain of in-place results land on one node. A written view stays its own root:
  lowering copies a view that is written (PopXL's view-like ops return new tensors),
  so writing it never reaches the view's source.

A node carries at most one of ``MODIFIES`` and ``VIEW_OF`` (``ir.build.emit`` records
one or the other; copying a node copies its records).

:func:`storage_owner` is the one function that follows these records; the passes that
ask "which storage is this?" differ only in its arguments (see its docstring).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Iterable

import torch.fx as fx

from ipuxl.ir.meta import MODIFIES, VIEW_OF, WRITES

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["storage_owner", "writes", "record_writes", "view_source", "is_view", "written_nodes", "is_written"]


def storage_owner(node: fx.Node, *, views: bool = True, copied: AbstractSet[fx.Node] = frozenset()) -> fx.Node:
    """The node owning the storage ``node``'s value lives in.

    Follows in-place results (``MODIFIES``) always, and views (``VIEW_OF``) unless the
    walk is told to stop there. Callers pick the question they ask:

    * ``storage_owner(n)``: the allocation ``n`` lives in, through in-place results and
      views (constant checks in ``emit``, liveness, the optimiser rules' write checks);
    * ``storage_owner(n, views=False)``: the *in-place root*, what ``WRITES`` records
      (``emit``, call arguments passed by reference);
    * ``storage_owner(n, copied=views)``: as ``storage_owner(n)``, but a view in
      ``copied`` owns its storage because lowering copies it (lowering passes the views
      it copies; in-place ordering the views some op writes).

    Args:
        node: any node of a graph.
        views: follow ``VIEW_OF`` records (else stop at the first view).
        copied: views that own their storage: the walk stops at them.

    Returns:
        ``node`` itself when it allocates, else the node whose storage it aliases.

    Example:
        >>> w = ipuxl.variable(np.zeros((2, 2), np.float32))
        >>> storage_owner(w.reshape((4,)).node) is w.node
        True
    """
    while True:
        parent = node.meta.get(MODIFIES)
        if parent is None:
            if not views or node in copied:
                return node
            parent = node.meta.get(VIEW_OF)
            if parent is None:
                return node
        node = parent


def writes(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` writes in place (empty for pure ops)."""
    return list(node.meta.get(WRITES, ()))


def record_writes(node: fx.Node, written: Iterable[fx.Node]) -> None:
    """Record that ``node`` writes ``written`` in place (each once, in order): for a node
    that replaces several writers (a device rewrite's fused call)."""
    node.meta[WRITES] = list(dict.fromkeys(written))


def view_source(node: fx.Node) -> fx.Node | None:
    """The input ``node`` is a view of, or ``None`` when it is not a view."""
    return node.meta.get(VIEW_OF)


def is_view(node: fx.Node) -> bool:
    """True when ``node`` is recorded as a view (its result shares an input's storage)."""
    return VIEW_OF in node.meta


def written_nodes(nodes: "Graph | Iterable[fx.Node]") -> set[fx.Node]:
    """Every node some op of ``nodes`` (a graph, or a sequence of its nodes) writes in place."""
    iterable = nodes.fx.nodes if hasattr(nodes, "fx") else nodes
    return {w for n in iterable for w in n.meta.get(WRITES, ())}


def is_written(graph: "Graph", node: fx.Node) -> bool:
    """True when an op of ``graph`` writes ``node`` in place (a modified input, say)."""
    return any(node in n.meta.get(WRITES, ()) for n in graph.fx.nodes)
