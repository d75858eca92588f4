"""Add an embedding's token gradients into the gradient they are summed with.

Rewrites: ``add(x, embedding_dense_backward(g, ids, n, pad, False))`` (either order), where
the embedding gradient has no other reader and has ``x``'s shape and dtype, becomes
``kernels.embedding.add_embedding_grad(x, g, ids, pad, in_place)``: the tokens' rows of
``g`` are added into ``x``. That is the gradient of a tied weight (GPT-2's and T5's
token embedding is also the language-model head: ``x`` is the head's ``mm`` gradient)
and of a table read at two places (T5's encoder and decoder inputs), which aten would
compute as table-sized zeros plus a table-sized addition per reading.

``in_place`` when ``x`` is a fresh tensor that nothing else reads: the result of a
matmul, of ``embedding_dense_backward`` or of an earlier ``add_embedding_grad`` with
this addition as its only reader. Otherwise the kernel adds into a copy of ``x``.
Chains (``(mm + E1) + E2``) become two in-place kernels on the matmul's result.

Preconditions: a lowered fx graph, dead code removed (so "only reader" counts real
readers). Inverse transpose pairs are folded first (``fold_inverse_transposes``). ``scale_grad_by_freq`` gradients are left alone.

Numerics: a row several tokens share is summed into ``x`` token by token instead of
summed first and added once: float32 rounding of that row may differ in its last bits.
Every other row is bit for bit aten's.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ipuxl.device.rewrites._nodes import embedding_grad_args, replace_node
from ipuxl.device.rewrites.inverse_transposes import fold_inverse_transposes
from ipuxl.kernels.embedding import add_embedding_grad
from ipuxl.passes.result import PassResult

__all__ = ["fuse_embedding_grads"]

_aten = torch.ops.aten
_ADDS = (torch.add, _aten.add.Tensor)
_EMBEDDING_GRAD = _aten.embedding_dense_backward.default
_FRESH = (_aten.mm.default, torch.mm, _aten.addmm.default, _EMBEDDING_GRAD, add_embedding_grad)
"""Targets whose result is a new tensor, aliasing nothing."""


def fuse_embedding_grads(graph: fx.Graph) -> PassResult:
    """Replace each sum of a dense embedding gradient and another gradient of its table
    (the module docstring's form) by ``add_embedding_grad``, after folding inverse
    transposes (a head's weight gradient is captured as ``t(t(mm(a, g)))``)."""
    changed = fold_inverse_transposes(graph).modified
    for node in list(graph.nodes):
        if not _is_plain_add(node):
            continue
        a, b = node.args
        for x, grad in ((a, b), (b, a)):
            if _dense_embedding_grad(grad, node) and isinstance(x, fx.Node) and _same_tensor_type(x, grad):
                g, ids, _, pad, _ = embedding_grad_args(grad)
                in_place = x.op == "call_function" and x.target in _FRESH and len(x.users) == 1
                replace_node(graph, node, add_embedding_grad, (x, g, ids, pad, in_place), {}, dead=(grad,))
                changed = True
                break
    return PassResult(graph, changed)


def _is_plain_add(node: fx.Node) -> bool:
    return bool(node.op == "call_function" and node.target in _ADDS and len(node.args) == 2
                and node.kwargs.get("alpha", 1) == 1 and set(node.kwargs) <= {"alpha"})


def _dense_embedding_grad(node: object, add: fx.Node) -> bool:
    """``node`` is an ``embedding_dense_backward`` without frequency scaling that ``add`` alone reads."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is _EMBEDDING_GRAD
            and list(node.users) == [add]):
        return False
    *_, pad, scale = embedding_grad_args(node)
    return scale is False and isinstance(pad, int)


def _same_tensor_type(x: fx.Node, grad: fx.Node) -> bool:
    """``x`` has the gradient's shape and dtype (the addition broadcasts and promotes nothing)."""
    mx, mg = x.meta.get("val"), grad.meta.get("val")
    return (isinstance(mx, torch.Tensor) and isinstance(mg, torch.Tensor) and mx.shape == mg.shape
            and mx.dtype == mg.dtype and mx.device == mg.device)
