"""Kernels of ``ipuxl.ops.nn``: the losses and inference batch normalisation."""
from __future__ import annotations

import torch

__all__ = ["nll_loss", "nll_loss_with_softmax_grad", "batch_norm_inference"]


def nll_loss(probs: torch.Tensor, labels: torch.Tensor, ignore_index: int | None,
             reduction: str, log_prob: bool) -> torch.Tensor:
    """Negative log-likelihood of ``labels`` under ``probs`` (log-probabilities when ``log_prob``;
    probabilities are clamped to a small epsilon before the log)."""
    classes = probs.shape[-1]
    flat_p = probs.reshape(-1, classes)
    flat_l = labels.reshape(-1).long()
    valid = flat_l != ignore_index if ignore_index is not None else None
    safe = torch.where(valid, flat_l, 0) if valid is not None else flat_l
    picked = flat_p.gather(1, safe.unsqueeze(1)).squeeze(1)
    eps = 6.104e-5 if probs.dtype == torch.float16 else 1e-7
    loss = -picked if log_prob else -torch.log(torch.clamp(picked, min=eps))
    if valid is not None:
        loss = torch.where(valid, loss, 0.0)  # not loss * valid: an ignored -inf log-prob would give nan
    if reduction == "none":
        return loss.reshape(labels.shape)
    if reduction == "sum":
        return loss.sum()
    count = valid.sum() if valid is not None else flat_l.numel()
    return loss.sum() / count


def nll_loss_with_softmax_grad(probs: torch.Tensor, labels: torch.Tensor, loss_grad: torch.Tensor | float,
                                ignore_index: int | None, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``nll_loss`` of softmax ``probs`` and its gradient with respect to the softmax's input."""
    loss = nll_loss(probs, labels, ignore_index, reduction, False)
    classes = probs.shape[-1]
    flat_p = probs.reshape(-1, classes)
    index = labels.reshape(-1, 1).long()
    valid = index != ignore_index if ignore_index is not None else None
    if valid is not None:
        index = torch.where(valid, index, 0)
    # probs - onehot(labels), without one_hot (which syncs the device to find the class count).
    grad = flat_p.scatter(1, index, flat_p.gather(1, index) - 1)
    if valid is not None:
        grad = torch.where(valid, grad, 0.0)
    scale = loss_grad
    if reduction == "mean":
        scale = scale / (valid.sum() if valid is not None else index.numel())
    if not (isinstance(scale, (int, float)) and scale == 1):
        grad = grad * scale
    return loss, grad.reshape(probs.shape)


def batch_norm_inference(t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
                         var: torch.Tensor, eps: float) -> torch.Tensor:
    """``scale * (t - mean) / sqrt(var + eps) + bias`` per channel (axis 1)."""
    shape = [-1 if d == 1 else 1 for d in range(t.dim())]  # per channel (axis 1)

    def channel(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(shape)

    # written out, not F.batch_norm: that has no gradient for the statistics
    return (t - channel(mean)) * torch.rsqrt(channel(var) + eps) * channel(scale) + channel(bias)
