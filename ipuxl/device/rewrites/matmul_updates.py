"""Fuse a matmul gradient into the in-place update that consumes it.

Rewrites, after folding inverse transpose pairs (``fold_inverse_transposes``, so that a
captured ``t(t(mm(a, g)))`` is seen as ``mm(a, g)``):

1. an SGD-style update ``W.add_(mm(a, g), alpha=c)`` (``ops.scaled_add_(W, dW, b=c)`` of a
   gradient ``dW = mm(a, g)``) becomes one BLAS call, ``W.addmm_(a, g, alpha=c)``;
2. the same update with a tensor factor ``s`` (a learning-rate variable),
   ``W.addcmul_(mm(a, g), s)``, becomes ``W.addmm_(a * s, g)`` or ``W.addmm_(a, g * s)``,
   scaling the smaller operand;
3. an SGD momentum update ``scaled_add_(buf, mm(a, g), m, c)`` (``c`` a number) becomes one
   GEMM into the buffer, ``kernels.var_updates.scaled_addmm_(buf, a, g, m, c)``.

The gradient is then never written to memory and read back.

Preconditions: a lowered fx graph (calls of single-site graphs already inlined, so the
gradient's matmul and its update sit in one graph). The matmul's result must have no
other reader.

Numerics: the same products and sums; only the final rounding of ``c * (a @ g)`` before
the addition may differ in the last bit. With a tensor factor each product of the scaled
operand is rounded once more (a relative difference of about 1e-7 of the update term).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ipuxl.device.rewrites._nodes import alpha, input_node, is_scalar, replace_node, update_term
from ipuxl.device.rewrites.inverse_transposes import fold_inverse_transposes
from ipuxl.ir.meta import OP, SOURCE
from ipuxl.kernels import var_updates
from ipuxl.kernels.elementwise import scaled_add_
from ipuxl.passes.result import PassResult

__all__ = ["fuse_matmul_updates"]

_MATMULS = (torch.ops.aten.mm.default, torch.mm)


def fuse_matmul_updates(graph: fx.Graph) -> PassResult:
    """Fold inverse transposes, then fuse each matmul gradient into its update (the module
    docstring's forms 1-3)."""
    changed = fold_inverse_transposes(graph).modified
    for node in list(graph.nodes):
        grad = update_term(node, _MATMULS)
        if grad is not None:  # 1. W.add_(mm(a, g), alpha=c)
            replace_node(graph, node, torch.Tensor.addmm_, (node.args[0], *grad.args), {"alpha": alpha(node)},
                         dead=(grad,))
            changed = True
        elif _fuse_scaled_matmul_update(graph, node) or _fuse_momentum_matmul_update(graph, node):  # 2. or 3.
            changed = True
    return PassResult(graph, changed)


def _fuse_momentum_matmul_update(graph: fx.Graph, node: fx.Node) -> bool:
    """``scaled_add_(buf, mm(a, g), m, c)`` (a momentum update, ``c`` a number) ->
    ``scaled_addmm_(buf, a, g, m, c)``, one GEMM into ``buf``; True if done."""
    if node.op != "call_function" or node.target is not scaled_add_ or len(node.args) != 4:
        return False
    term, factor, b = node.args[1], node.args[2], node.args[3]
    if not (isinstance(term, fx.Node) and term.target in _MATMULS and len(term.users) == 1
            and isinstance(b, (int, float)) and is_scalar(factor)):
        return False
    replace_node(graph, node, var_updates.scaled_addmm_, (node.args[0], *term.args, factor, b), {},
                 dead=(term,))
    return True


def _fuse_scaled_matmul_update(graph: fx.Graph, node: fx.Node) -> bool:
    """``W.addcmul_(mm(a, g), s)`` -> ``W.addmm_(a * s, g)`` or ``W.addmm_(a, g * s)``; True if done."""
    match = _scaled_update_term(node)
    if match is None:
        return False
    grad, a, g, factor = match
    scale_a = _numel(a) < _numel(g)
    with graph.inserting_before(node):
        scaled = graph.call_function(torch.mul, ((a if scale_a else g), factor))
    scaled.meta["val"] = (a if scale_a else g).meta.get("val")
    # part of the user's update: errors name its op and line (not its writes: it writes nothing)
    scaled.meta.update({k: node.meta[k] for k in (OP, SOURCE) if k in node.meta})
    replace_node(graph, node, torch.Tensor.addmm_, (node.args[0], *((scaled, g) if scale_a else (a, scaled))), {},
                 dead=(grad,))
    return True


def _scaled_update_term(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """``(t, a, g, s)`` of ``W.addcmul_(t, s)`` with ``t = mm(a, g)`` used only there and a
    0-dim tensor ``s``."""
    if not (node.op == "call_function" and node.target is torch.Tensor.addcmul_ and len(node.args) == 3
            and not node.kwargs):
        return None
    term, factor = input_node(node, 1), input_node(node, 2)
    if term is None or factor is None or term.target not in _MATMULS or len(term.users) != 1:
        return None
    a, g = input_node(term, 0), input_node(term, 1)
    factor_val = factor.meta.get("val")
    if a is None or g is None or factor_val is None or factor_val.dim() != 0:
        return None
    return term, a, g, factor


def _numel(node: fx.Node) -> float:
    val = node.meta.get("val")
    return float("inf") if val is None else val.numel()
