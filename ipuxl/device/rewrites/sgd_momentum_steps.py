"""Fuse an SGD momentum step into one pass over the weight, its buffer and its gradient.

Rewrites: a momentum update ``scaled_add_(buf, g, m, 1)`` (``buf = m * buf + g``) followed
by its weight update ``W.addcmul_(buf, -lr)`` becomes one
``kernels.var_updates.sgd_momentum_step_(W, buf, g, m, -lr)`` where the weight update was.
(A momentum update of a matmul gradient has become one GEMM already, in
``fuse_matmul_updates``.)

Preconditions: a lowered fx graph; ``m`` and ``-lr`` are Python numbers or 0-dim tensors;
the momentum update's only reader is the weight update, and no node between the two reads
or writes ``buf``, ``g`` or ``W``.

Numerics: bit for bit the unfused steps (torch's fused SGD kernel on large CPU tensors
rounds as they do; see ``sgd_momentum_step_``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ipuxl.device.rewrites._nodes import is_scalar, replace_node
from ipuxl.kernels import var_updates
from ipuxl.kernels.elementwise import scaled_add_
from ipuxl.passes.result import PassResult

__all__ = ["fuse_sgd_momentum_steps"]


def fuse_sgd_momentum_steps(graph: fx.Graph) -> PassResult:
    """Replace each fusable momentum update and weight update pair by one ``sgd_momentum_step_``."""
    changed = False
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is scaled_add_ and len(node.args) == 4
                and node.args[3] == 1 and is_scalar(node.args[2]) and len(node.users) == 1):
            continue
        update = next(iter(node.users))
        if not (update.target is torch.Tensor.addcmul_ and len(update.args) == 3 and not update.kwargs
                and update.args[1] is node and is_scalar(update.args[2])):
            continue
        buf, grad, weight = node.args[0], node.args[1], update.args[0]
        if not all(isinstance(t, fx.Node) for t in (buf, grad, weight)) or _touched_between(node, update,
                                                                                              {buf, grad, weight}):
            continue
        replace_node(graph, update, var_updates.sgd_momentum_step_,
                     (weight, buf, grad, node.args[2], update.args[2]), {}, dead=(node,))
        changed = True
    return PassResult(graph, changed)


def _touched_between(first: fx.Node, last: fx.Node, tensors: set[Any]) -> bool:
    """Whether a node strictly between ``first`` and ``last`` takes one of ``tensors`` as an argument."""
    node = first.next
    while node is not last:
        if any(arg in tensors for arg in node.all_input_nodes):
            return True
        node = node.next
    return False
