"""Fuse an Adam update term into its weight update.

Rewrites: ``W.add_(adam_updater(m, v, None, step, None, b1, b2, eps), alpha=c)`` (an
Adam-style update without weight decay) becomes one
``kernels.var_updates.adam_update_(W, m, v, step, b1, b2, eps, c)``, an ``addcdiv_``, so the
update term is never materialised. Runs after ``fuse_adam_steps``, on the updates that
did not fuse whole.

Preconditions: a lowered fx graph; the updater's only reader is the weight update; no
weight decay; the updater's result has ``W``'s dtype.

Numerics: the same denominator; ``addcdiv_`` adds ``c * m / denom`` without first rounding
the quotient ``m / denom`` to a tensor, so the update may differ in the last bit.
"""
from __future__ import annotations

import torch.fx as fx

from ipuxl.device.rewrites._nodes import alpha, input_node, replace_node, update_term, val
from ipuxl.kernels import var_updates
from ipuxl.passes.result import PassResult

__all__ = ["fuse_adam_updates"]


def fuse_adam_updates(graph: fx.Graph) -> PassResult:
    """Replace each ``W.add_(adam_updater(...), alpha=c)`` without weight decay by one ``adam_update_``."""
    changed = False
    for node in list(graph.nodes):
        term = update_term(node, (var_updates.adam_updater,))
        weight = input_node(node, 0)
        if term is None or weight is None:
            continue
        m, v, _, step, wd, beta1, beta2, eps = term.args
        if wd is not None or val(term).dtype != val(weight).dtype:
            continue
        replace_node(graph, node, var_updates.adam_update_, (weight, m, v, step, beta1, beta2, eps, alpha(node)), {},
                     dead=(term,))
        changed = True
    return PassResult(graph, changed)
