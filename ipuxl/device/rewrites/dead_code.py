"""Dead-code elimination for lowered graphs, sound for side effects.

Rewrites: removes ``call_function`` nodes whose result nothing reads, when they are known
to be pure. Typical win: the gradient of the input images, which ``autodiff`` computes
by default (as PopXL does) and nothing reads.

Preconditions: a lowered fx graph whose in-place writes ipuxl recorded (``ir.aliases``).
``torch.fx``'s own DCE treats every Python callable as pure, so it would delete
``Tensor.add_`` and other in-place updates (docs/architecture.md, "Traps in torch.fx").
This pass only removes aten ops whose schema mutates nothing, tuple indexing,
``torch.clone`` and the device's kernel choices (``ipuxl.kernels.conv.convolution_backward``,
``ipuxl.kernels.pool.max_pool2d_with_indices``), and never a node recorded as writing a
tensor. Every other Python function is kept, used or not, and so are the runtime checks
(``aten._assert_async``, ``aten._assert_scalar``): their schema mutates nothing and they return
nothing, but their effect is the error they raise (``capture.runtime_checks``).

Numerics: unchanged (only unread results are removed).

Steps: walk the nodes in reverse order, so that a chain of unread pure nodes goes in one
pass; remove each unread pure node.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from ipuxl.ir.aliases import writes
from ipuxl.kernels.conv import convolution_backward
from ipuxl.kernels.pool import max_pool2d_with_indices
from ipuxl.passes.result import PassResult

__all__ = ["eliminate_dead_code"]

_PURE: frozenset[Callable[..., Any]] = frozenset(
    {operator.getitem, torch.clone, convolution_backward, max_pool2d_with_indices})
_CHECKS = frozenset({torch.ops.aten._assert_async.default, torch.ops.aten._assert_async.msg,
                     torch.ops.aten._assert_scalar.default})


def eliminate_dead_code(graph: fx.Graph) -> PassResult:
    """Remove unused pure nodes (in reverse order, so chains go too)."""
    changed = False
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and _is_pure(node):
            graph.erase_node(node)
            changed = True
    return PassResult(graph, changed)


def _is_pure(node: fx.Node) -> bool:
    if writes(node):
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return not target._schema.is_mutable and target not in _CHECKS
    return target in _PURE
