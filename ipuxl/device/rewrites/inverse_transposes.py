"""Fold pairs of transposing views that undo each other.

Rewrites: ``t(t(x))``, ``transpose(transpose(x, i, j), i, j)`` and ``permute(permute(x, p), q)``
with ``q`` undoing ``p`` become ``x`` itself in the ops that read them; the views are
erased once nothing reads them. Gradients captured from modules (``make_fx``) reach their
update as ``t(t(mm(a, g)))`` (autograd keeps ``W.t()``'s layout for the gradient of
``W.t()``, then transposes it back), so folding lets ``fuse_matmul_updates`` see the matmul.

Preconditions: a lowered fx graph with a meta tensor on each view. A view ipuxl recorded
as writing a tensor is not touched.

Numerics: unchanged. Such a pair is a view of ``x`` with ``x``'s own sizes, strides and
offset, so every reader (in-place writers included) sees the same elements through
``x``. Graph outputs keep the view (lowering decided their copies already).

Steps:
1. For each node, find whether it is a transposing view of a transposing view of ``x``
   that undoes it (``_inverse_pair``).
2. Let its readers other than the output read ``x``.
3. Erase the outer view when nothing reads it any more, then the inner one likewise.
"""
from __future__ import annotations

from typing import Any, Sequence, cast

import torch
import torch.fx as fx

from ipuxl.device.rewrites._nodes import input_node
from ipuxl.ir.aliases import writes
from ipuxl.passes.result import PassResult

__all__ = ["fold_inverse_transposes"]

_aten = torch.ops.aten


def fold_inverse_transposes(graph: fx.Graph) -> PassResult:
    """Read ``x`` instead of a pair of transposing views of ``x`` that undo each other."""
    changed = False
    for node in list(graph.nodes):
        # 1. a view of a view that undoes it
        pair = _inverse_pair(node)
        if pair is None:
            continue
        inner, source = pair
        # 2. its readers read the source instead
        readers = [user for user in node.users if user.op != "output"]
        for user in readers:
            user.replace_input_with(node, source)
        changed = changed or bool(readers)
        # 3. unread views go
        if not node.users:
            graph.erase_node(node)
            if not inner.users:
                graph.erase_node(inner)
    return PassResult(graph, changed)


def _ints(values: Sequence[Any]) -> list[int] | None:
    """``values`` as ints, or None when one of them is not an int."""
    return list(values) if all(isinstance(v, int) for v in values) else None


def _transpose_permutation(node: fx.Node) -> list[int] | None:
    """The dimension permutation a pure transposing view applies, or None."""
    if node.op != "call_function" or writes(node) or node.kwargs:
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    rank = val.dim()
    if node.target is _aten.t.default and len(node.args) == 1:
        return [1, 0] if rank == 2 else list(range(rank))
    if node.target is _aten.transpose.int and len(node.args) == 3:
        dims = _ints(node.args[1:])
        if dims is None:
            return None
        i, j = (d % rank if rank else 0 for d in dims)
        perm = list(range(rank))
        if rank:
            perm[i], perm[j] = perm[j], perm[i]
        return perm
    if node.target is _aten.permute.default and len(node.args) == 2:
        order = _ints(cast(Sequence[Any], node.args[1]))
        return None if order is None else [d % rank for d in order]
    return None


def _inverse_pair(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(inner, x)`` when ``node`` is a transposing view of a transposing view ``inner`` of
    ``x`` that undoes it."""
    outer = _transpose_permutation(node)
    inner_node = input_node(node, 0)
    if outer is None or inner_node is None:
        return None
    inner = _transpose_permutation(inner_node)
    source = input_node(inner_node, 0)
    if inner is None or len(inner) != len(outer) or source is None:
        return None
    if [inner[d] for d in outer] != list(range(len(outer))):
        return None
    return inner_node, source
