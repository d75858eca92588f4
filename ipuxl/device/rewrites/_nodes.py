"""Typed access to fx nodes and the node surgery the device rewrites share.

Every rewrite works on a lowered fx graph (``ipuxl.ir.lower``): each tensor-valued node
carries its meta tensor in ``meta["val"]``, and an update ``W.add_(t, alpha=c)`` is a
``call_function`` of ``torch.Tensor.add_``.
"""
from __future__ import annotations

from typing import Any, Callable, cast

import torch
import torch.fx as fx

__all__ = ["input_node", "val", "alpha", "is_scalar", "update_term", "replace_node", "retarget", "embedding_grad_args"]


def input_node(node: fx.Node, i: int) -> fx.Node | None:
    """Argument ``i`` of ``node`` when it is a node (None when it is a constant or missing)."""
    arg = node.args[i] if i < len(node.args) else None
    return arg if isinstance(arg, fx.Node) else None


def val(node: fx.Node) -> torch.Tensor:
    """The meta tensor of ``node``'s result (lowering keeps one on every tensor-valued node)."""
    return cast(torch.Tensor, node.meta["val"])


def alpha(node: fx.Node) -> Any:
    """The ``alpha`` of an update ``W.add_(t, alpha=c)`` (1 when not given)."""
    return node.kwargs.get("alpha", 1)


def is_scalar(value: Any) -> bool:
    """A Python number or a node of a 0-dimensional tensor."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    meta = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(meta, torch.Tensor) and meta.dim() == 0


def _is_update(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.Tensor.add_ and len(node.args) == 2
            and set(node.kwargs) <= {"alpha"})


def update_term(node: fx.Node, targets: tuple[Callable[..., Any], ...]) -> fx.Node | None:
    """The term ``t`` of an update ``W.add_(t, alpha=c)`` when ``t`` is one of ``targets``, used only there."""
    if not _is_update(node):
        return None
    term = input_node(node, 1)
    if term is not None and term.target in targets and len(term.users) == 1:
        return term
    return None


def replace_node(graph: fx.Graph, node: fx.Node, target: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], dead: tuple[fx.Node, ...]) -> None:
    """Put ``target(*args, **kwargs)`` where update ``node`` was (with its meta: its op,
    source line and writes) and erase it and the ``dead`` nodes."""
    with graph.inserting_before(node):
        fused = graph.call_function(target, args, kwargs)
    fused.meta.update(node.meta)
    node.replace_all_uses_with(fused)
    for erased in (node, *dead):
        graph.erase_node(erased)


def retarget(graph: fx.Graph, targets: dict[Any, Callable[..., Any]]) -> bool:
    """Call ``targets[f]`` wherever the graph calls ``f``; True if any changed."""
    changed = False
    for node in graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = targets[node.target]
            changed = True
    return changed


def embedding_grad_args(node: fx.Node) -> tuple[Any, ...]:
    """An ``embedding_dense_backward`` node's ``(grad_output, indices, num_weights, padding_idx,
    scale_grad_by_freq)``, given by position or by name."""
    names = ("grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq")
    return tuple(node.args[i] if i < len(node.args) else node.kwargs[n] for i, n in enumerate(names))
