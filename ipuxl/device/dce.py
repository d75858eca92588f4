"""Dead-code elimination for lowered graphs, sound for side effects.

``torch.fx``'s own DCE treats every Python callable as pure, so it would delete
``Tensor.add_`` and other in-place updates (see the DESIGN note). This pass only
removes nodes known to be pure: aten ops whose schema mutates nothing, tuple
indexing, ``torch.clone`` and functions marked with ``pure`` (the device's kernel
choices, ``device.fuse.select_kernels``), and never a node ipuxl recorded as writing a tensor.
Typical win: the gradient of the input images, which ``autodiff`` computes by
default (as PopXL does) and nothing reads.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, TypeVar

import torch
import torch.fx as fx

from ipuxl.ir.aliases import writes

__all__ = ["eliminate_dead_code", "pure"]

F = TypeVar("F", bound=Callable[..., Any])

_PURE: set[Callable[..., Any]] = {operator.getitem, torch.clone}


def pure(fn: F) -> F:
    """Mark ``fn`` as free of side effects: an unused call of it may be removed."""
    _PURE.add(fn)
    return fn


def eliminate_dead_code(graph: fx.Graph) -> bool:
    """Remove unused pure nodes (in reverse order, so chains go too); True if any was removed."""
    changed = False
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and _is_pure(node):
            graph.erase_node(node)
            changed = True
    return changed


def _is_pure(node: fx.Node) -> bool:
    if writes(node):
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return not target._schema.is_mutable
    return target in _PURE
