"""Fuse a whole bias-corrected Adam step of one weight into torch's fused Adam kernel.

Rewrites: the moment updates ``moving_average_(m, g, beta1)`` and
``moving_average_square_(v, g, beta2)``, the ``adam_updater`` that reads them and the
weight update ``W.add_(updater, alpha=-lr)`` become one
``kernels.var_updates.fused_adam_step_(W, g, m, v, step, lr, beta1, beta2, eps)`` where the
weight update was.

Preconditions: a lowered fx graph; bias correction on (a step counter read only by the
updater), no weight decay and no weight in the updater; ``beta1``, ``beta2``, ``eps`` and
``lr`` Python numbers; both moments updated from one gradient, each moment and each
moment update read by nothing else; weight, gradient, moments and update term of one
dtype, float32 or float16 (not float64).

Numerics: the fused kernel's. Its moment factors are the Python numbers in double
precision, not rounded to float32 as the unfused kernels round them.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, cast

import torch
import torch.fx as fx

from ipuxl.device.rewrites._nodes import alpha, input_node, replace_node, update_term, val
from ipuxl.kernels import var_updates
from ipuxl.passes.result import PassResult

__all__ = ["fuse_adam_steps"]


class _AdamStep(NamedTuple):
    """The nodes of one weight's fusable Adam step, ended by the weight update."""

    updater: fx.Node
    first_moment: fx.Node  # moving_average_(m, grad, beta1)
    second_moment: fx.Node  # moving_average_square_(v, grad, beta2)
    step: fx.Node


def fuse_adam_steps(graph: fx.Graph) -> PassResult:
    """Replace each fusable Adam step (see the module docstring) by one ``fused_adam_step_``."""
    changed = False
    for node in list(graph.nodes):
        match = _adam_step(node)
        if match is None:
            continue
        term, m_node, v_node = match.updater, match.first_moment, match.second_moment
        lr, beta1, beta2, eps = -alpha(node), term.args[5], term.args[6], term.args[7]
        args = (node.args[0], m_node.args[1], m_node.args[0], v_node.args[0], match.step, lr, beta1, beta2, eps)
        replace_node(graph, node, var_updates.fused_adam_step_, args, {}, dead=(term, v_node, m_node))
        changed = True
    return PassResult(graph, changed)


def _adam_step(node: fx.Node) -> _AdamStep | None:
    """The Adam step ``node`` ends, when it can be fused: bias-corrected, no weight decay,
    number factors, moments updated just before from one gradient and read by nothing
    else, all tensors of one dtype other than float64."""
    term = update_term(node, (var_updates.adam_updater,))
    if term is None:
        return None
    _, _, w, _, wd, beta1, beta2, eps = term.args
    step = input_node(term, 3)
    if w is not None or wd is not None or step is None or len(step.users) != 1 or not all(
            isinstance(x, (int, float)) for x in (beta1, beta2, eps, alpha(node))):
        return None
    m_node = _moment_update(term, 0, var_updates.moving_average_, beta1)
    v_node = _moment_update(term, 1, var_updates.moving_average_square_, beta2)
    if m_node is None or v_node is None or m_node.args[1] is not v_node.args[1]:
        return None
    tensors = [node.args[0], m_node.args[1], m_node.args[0], v_node.args[0]]
    if not all(isinstance(t, fx.Node) for t in tensors):
        return None
    dtypes = {val(t).dtype for t in cast(list[fx.Node], tensors)} | {val(term).dtype}
    if len(dtypes) != 1 or dtypes & {torch.float64}:
        return None
    return _AdamStep(term, m_node, v_node, step)


def _moment_update(term: fx.Node, i: int, kernel: Callable[..., Any], beta: Any) -> fx.Node | None:
    """Argument ``i`` of the updater ``term`` when it is ``kernel(moment, grad, beta)``, the
    only reader of its result, and the moment has no other reader."""
    update = input_node(term, i)
    if update is None or update.target is not kernel or update.args[2] != beta or len(update.users) != 1:
        return None
    moment = input_node(update, 0)
    return update if moment is not None and len(moment.users) == 1 else None
