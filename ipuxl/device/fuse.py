"""Compile-time fusion of gradients and optimiser terms into their in-place updates.

1. An SGD-style update ``ops.scaled_add_(W, dW, b=c)`` of a gradient computed by a
matmul, ``dW = mm(a, g)``, becomes one BLAS call, ``W.addmm_(a, g, alpha=c)``
(``W + c * (a @ g)``): the gradient is never written to memory and read back.
Numerics: the same products and sums; only the final rounding of ``c * (a @ g)``
before the addition may differ in the last bit.

2. An Adam-style update ``ops.scaled_add_(W, adam_updater(m, v, ...), b=c)`` without
weight decay becomes one ``addcdiv_`` (``var_updates._adam_update_``) when the
updater's result has ``W``'s dtype, so the update term is never materialised.

Preconditions: a lowered fx graph (calls of single-site graphs already inlined, so
the gradient's matmul and its update sit in one graph). The matmul's result must
have no other user.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ipuxl.ops.var_updates import _adam_update_, _adam_updater

__all__ = ["fuse_matmul_updates", "fuse_adam_updates"]

_MATMULS = (torch.ops.aten.mm.default, torch.mm)


def fuse_matmul_updates(graph: fx.Graph) -> bool:
    """Rewrite ``W.add_(mm(a, g), alpha=c)`` as ``W.addmm_(a, g, alpha=c)``; True if any changed."""
    changed = False
    for node in list(graph.nodes):
        if not _is_update(node):
            continue
        grad = node.args[1]
        if not (isinstance(grad, fx.Node) and grad.target in _MATMULS and len(grad.users) == 1):
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(torch.Tensor.addmm_, (node.args[0], *grad.args),
                                        {"alpha": node.kwargs.get("alpha", 1)})
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        graph.erase_node(grad)
        changed = True
    return changed


def _is_update(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.Tensor.add_ and len(node.args) == 2
            and set(node.kwargs) <= {"alpha"})


def fuse_adam_updates(graph: fx.Graph) -> bool:
    """Rewrite ``W.add_(adam_updater(m, v, None, step, None, b1, b2, eps), alpha=c)`` as one fused update."""
    changed = False
    for node in list(graph.nodes):
        if not _is_update(node):
            continue
        term = node.args[1]
        if not (isinstance(term, fx.Node) and term.target is _adam_updater and len(term.users) == 1):
            continue
        m, v, w, step, wd, beta1, beta2, eps = term.args
        weight = node.args[0]
        if wd is not None or term.meta["val"].dtype != weight.meta["val"].dtype:
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(_adam_update_, (weight, m, v, step, beta1, beta2, eps, node.kwargs.get("alpha", 1)))
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        graph.erase_node(term)
        changed = True
    return changed
