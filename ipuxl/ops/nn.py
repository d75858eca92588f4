"""Neural-network ops: matmul, softmax, losses, normalisation, convolution."""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from ipuxl.ir.build import emit
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.ops.shape import cast

__all__ = [
    "matmul", "softmax", "log_softmax", "nll_loss", "nll_loss_with_softmax_grad",
    "layer_norm", "conv", "max_pool", "average_pool",
]

Reduction = Literal["mean", "sum", "none"]


def matmul(lhs: Tensor, rhs: Tensor, available_memory_proportion: float | None = None,
           output_type: torch.dtype | None = None, partials_type: torch.dtype | None = None) -> Tensor:
    """``numpy.matmul`` semantics. The IPU-specific tuning arguments are accepted and ignored."""
    out = emit("matmul", torch.matmul, (lhs, rhs))
    if output_type is not None and output_type != out.dtype:
        out = cast(out, output_type)
    return out


def softmax(t: Tensor, axis: int) -> Tensor:
    """Softmax along ``axis``."""
    return emit("softmax", torch.softmax, (t, axis))


def log_softmax(t: Tensor, axis: int) -> Tensor:
    """Log-softmax along ``axis`` (not in PopXL; provided because torch maps it directly)."""
    return emit("log_softmax", torch.log_softmax, (t, axis))


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise InvalidArgumentError(f"not a valid reduction: {reduction!r}", where=user_source_line(),
                                   fix="choose from 'mean', 'sum', 'none'")


def _nll(probs: torch.Tensor, labels: torch.Tensor, ignore_index: int | None,
         reduction: str, log_prob: bool) -> torch.Tensor:
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


def nll_loss(probs: Tensor, labels: Tensor, ignore_index: int | None = None,
             reduction: Reduction = "mean", log_prob: bool = False) -> Tensor:
    """Negative log-likelihood of ``labels`` under ``probs`` (``-log(max(p, 1e-7))``)."""
    _check_reduction(reduction)
    return emit("nll_loss", _nll, (probs, labels, ignore_index, reduction, log_prob), name="loss")


def _nll_softmax_grad(probs: torch.Tensor, labels: torch.Tensor, loss_grad: torch.Tensor | float,
                      ignore_index: int | None, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    loss = _nll(probs, labels, ignore_index, reduction, False)
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


def nll_loss_with_softmax_grad(probs: Tensor, labels: Tensor, loss_grad: float | Tensor = 1,
                               ignore_index: int | None = None,
                               reduction: Reduction = "mean") -> tuple[Tensor, Tensor]:
    """NLL loss of softmax ``probs`` and its gradient w.r.t. the softmax *input*.

    Returns ``(loss, dx)`` with ``dx = (probs - onehot(labels)) * loss_grad`` (divided
    by the number of counted labels for ``"mean"``), as PopXL's op.
    """
    _check_reduction(reduction)
    loss, dx = emit("nll_loss_with_softmax_grad", _nll_softmax_grad,
                    (probs, labels, loss_grad, ignore_index, reduction), num_outputs=2, name="loss")
    return loss, dx


def layer_norm(t: Tensor, weight: Tensor, bias: Tensor, epsilon: float = 1e-5) -> Tensor:
    """Layer normalisation over the last axis, scaled by ``weight`` and shifted by ``bias``."""
    return emit("layer_norm", F.layer_norm, (t, (t.shape[-1],), weight, bias, epsilon))


def conv(t: Tensor, weight: Tensor, stride: tuple[int, ...] = (1, 1), padding: tuple[int, ...] = (0, 0, 0, 0),
         dilation: tuple[int, ...] = (1, 1), groups: int = 1) -> Tensor:
    """2-D convolution, NCHW. ``padding`` is PopXL's (begin..., end...) and must be symmetric."""
    half = len(padding) // 2
    if tuple(padding[:half]) != tuple(padding[half:]):
        raise InvalidArgumentError(f"asymmetric padding {padding} is not supported", where=user_source_line(),
                                   fix="pad the input with ops.pad or use symmetric padding")
    return emit("conv", F.conv2d, (t, weight, None, tuple(stride), tuple(padding[:half]), tuple(dilation), groups))


def max_pool(t: Tensor, kernel_size: tuple[int, int], stride: tuple[int, int] | None = None) -> Tensor:
    """2-D max pooling, NCHW."""
    return emit("max_pool", F.max_pool2d, (t, tuple(kernel_size), tuple(stride or kernel_size)))


def average_pool(t: Tensor, kernel_size: tuple[int, int], stride: tuple[int, int] | None = None) -> Tensor:
    """2-D average pooling, NCHW."""
    return emit("average_pool", F.avg_pool2d, (t, tuple(kernel_size), tuple(stride or kernel_size)))
