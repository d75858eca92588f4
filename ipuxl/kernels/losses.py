"""Kernels of loss gradients: cross-entropy's gradient without its dense intermediates.

Eager autograd computes the gradient of ``nll_loss(log_softmax(x))`` in two table-sized
steps: ``nll_loss_backward`` writes zeros of the logits' size with one value per row (at
the row's target), then ``_log_softmax_backward_data`` reads that and the log-softmax
output and writes the logits' gradient. For a language model's head (tens of thousands of
classes per token) each is as large as the logits. ``log_softmax_nll_grad`` computes the
same gradient from the log-softmax output alone, in one pass, and can write it over that
output when nothing reads it afterwards. ``ipuxl.device.rewrites.cross_entropy_grads``
puts it in place of the two steps.
"""
from __future__ import annotations

import torch

__all__ = ["log_softmax_nll_grad", "REDUCTIONS"]

REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
"""aten's reduction codes (``torch.nn._reduction``)."""


def log_softmax_nll_grad(log_probs: torch.Tensor, grad_output: torch.Tensor, target: torch.Tensor,
                         weight: torch.Tensor | None, reduction: int, ignore_index: int,
                         total_weight: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``_log_softmax_backward_data(nll_loss_backward(grad_output, log_probs, target, weight,
    reduction, ignore_index, total_weight), log_probs, 1, log_probs.dtype)`` for 2-D
    ``log_probs`` (rows, classes), written over ``log_probs`` when ``in_place``.

    Row ``i``'s gradient is ``g_i * onehot(target_i) - exp(log_probs_i) * g_i`` with
    ``g_i`` the value nll's gradient puts at the target (``-weight[t] * grad / total_weight``
    for "mean", without the division for "sum", ``-weight[t] * grad_output[i]`` for "none";
    0 for an ignored row), each product and sum rounded as aten's kernels round them. The
    only difference: ``exp`` is torch's elementwise kernel, where aten's log-softmax
    backward may vectorise it differently (last-bit differences at most).
    """
    rows = log_probs.shape[0]
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros((), dtype=target.dtype, device=target.device))
    grad = -(grad_output / total_weight) if REDUCTIONS[reduction] == "mean" else -grad_output
    scale = (weight[safe] * grad if weight is not None else grad.expand(rows)).to(log_probs.dtype)
    scale = torch.where(valid, scale, torch.zeros((), dtype=scale.dtype, device=scale.device))
    out = torch.exp(log_probs, out=log_probs) if in_place else torch.exp(log_probs)
    # 0 - s, not -s: an ignored row's gradient is +0, as aten's (0 - exp * 0)
    out.mul_(torch.sub(0.0, scale).unsqueeze(1))
    return out.scatter_add_(1, safe.unsqueeze(1), scale.unsqueeze(1))
