"""Batched matmuls of a broadcast matrix folded into one matmul, as eager folds them.

``torch.matmul`` of a batched operand (3 or more dims) by a matrix, which
``F.linear`` reaches for a non-contiguous input, chooses in C++ between folding the
batch into rows (``x.reshape(-1, k) @ w``: one ``mm``, copying ``x`` when it cannot be
viewed so) and broadcasting the matrix (``bmm`` of ``x`` with ``w`` expanded to every
batch entry). Eager folds whenever the matrix requires grad, because the broadcast
program's backward computes one weight gradient per batch entry and then sums them.
A traced tensor never requires grad in C++, so a capture records the broadcast
program: in a ViT, whose ``nn.MultiheadAttention(batch_first=True)`` projects a
transposed input, its matmuls took 2.5x eager's time.

``fold_broadcast_matmuls`` rewrites, in a captured aten graph, each
``bmm(a, view(expand(m)))`` whose second operand is one matrix ``m`` repeated over
the batch into ``view(mm(rows(a), m))``, where ``rows(a)`` is ``a`` viewed (or, when
its layout does not allow that, copied then viewed) as a matrix of rows: the
products and sums eager's folded matmul computes, and a backward of two ``mm``.
Run it before the graph is differentiated.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ipuxl.capture.mutations import traced_call

__all__ = ["fold_broadcast_matmuls"]

_aten = torch.ops.aten


def fold_broadcast_matmuls(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s broadcast-matrix ``bmm`` nodes in place; returns how many."""
    graph, folded = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _aten.bmm.default:
            continue
        a, b = node.args[:2]
        matrix = _broadcast_matrix(b)
        if not isinstance(a, fx.Node) or matrix is None:
            continue
        batch, m, k = a.meta["val"].shape
        with graph.inserting_before(node):
            rows = a if _viewable_as_rows(a.meta["val"]) else traced_call(
                graph, node, _aten.clone.default, (a,), {"memory_format": torch.contiguous_format})
            rows = traced_call(graph, node, _aten.view.default, (rows, [batch * m, k]), {})
            product = traced_call(graph, node, _aten.mm.default, (rows, matrix), {})
            out = traced_call(graph, node, _aten.view.default, (product, list(node.meta["val"].shape)), {})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        folded += 1
    if folded:
        graph.eliminate_dead_code()
        gm.recompile()
    return folded


def _broadcast_matrix(b: Any) -> fx.Node | None:
    """The matrix ``m`` when ``b`` is ``view(expand(m, [*batch, k, n]), [B, k, n])`` (or the
    expand itself, already 3-D) with ``m`` 2-D: every batch entry of ``b`` is ``m``."""
    if isinstance(b, fx.Node) and b.target is _aten.view.default:
        b = b.args[0]
    if not (isinstance(b, fx.Node) and b.target is _aten.expand.default):
        return None
    source = b.args[0]
    if not isinstance(source, fx.Node) or source.meta["val"].dim() != 2:
        return None
    return source if tuple(b.meta["val"].shape[-2:]) == tuple(source.meta["val"].shape) else None


def _viewable_as_rows(value: torch.Tensor) -> bool:
    """Whether a 3-D tensor views as ``(B * m, k)`` without a copy."""
    batch, m, _ = value.shape
    return batch == 1 or m == 1 or value.stride(0) == value.stride(1) * m

