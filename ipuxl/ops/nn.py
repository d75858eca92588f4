"""Neural-network ops: matmul, softmax, losses, normalisation, convolution."""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from ipuxl.dtypes import from_any
from ipuxl.ir.build import emit
from ipuxl.errors import InvalidArgumentError, ShapeMismatchError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import nn as kernels
from ipuxl.ops.conv import average_pool, conv, max_pool
from ipuxl.ops.shape import cast

__all__ = [
    "matmul", "softmax", "log_softmax", "nll_loss", "nll_loss_with_softmax_grad",
    "layer_norm", "group_norm", "batch_norm_inference", "conv", "max_pool", "average_pool",
]

Reduction = Literal["mean", "sum", "none"]


def matmul(lhs: Tensor, rhs: Tensor, available_memory_proportion: float | None = None,
           output_type: torch.dtype | None = None, partials_type: torch.dtype | None = None) -> Tensor:
    """``numpy.matmul`` semantics. The IPU-specific tuning arguments are accepted and ignored."""
    out = emit("matmul", torch.matmul, (lhs, rhs))
    if output_type is not None and from_any(output_type) != out.spec.dtype:
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


def nll_loss(probs: Tensor, labels: Tensor, ignore_index: int | None = None,
             reduction: Reduction = "mean", log_prob: bool = False) -> Tensor:
    """Negative log-likelihood of ``labels`` under ``probs`` (``-log(max(p, 1e-7))``)."""
    _check_reduction(reduction)
    return emit("nll_loss", kernels.nll_loss, (probs, labels, ignore_index, reduction, log_prob), name="loss")


def nll_loss_with_softmax_grad(probs: Tensor, labels: Tensor, loss_grad: float | Tensor = 1,
                               ignore_index: int | None = None,
                               reduction: Reduction = "mean") -> tuple[Tensor, Tensor]:
    """NLL loss of softmax ``probs`` and its gradient w.r.t. the softmax *input*.

    Returns ``(loss, dx)`` with ``dx = (probs - onehot(labels)) * loss_grad`` (divided
    by the number of counted labels for ``"mean"``), as PopXL's op.
    """
    _check_reduction(reduction)
    loss, dx = emit("nll_loss_with_softmax_grad", kernels.nll_loss_with_softmax_grad,
                    (probs, labels, loss_grad, ignore_index, reduction), num_outputs=2, name="loss")
    return loss, dx


def layer_norm(t: Tensor, weight: Tensor, bias: Tensor, epsilon: float = 1e-5) -> Tensor:
    """Layer normalisation over the last axis, scaled by ``weight`` and shifted by ``bias``."""
    return emit("layer_norm", F.layer_norm, (t, (t.shape[-1],), weight, bias, epsilon))


def group_norm(t: Tensor, weight: Tensor, bias: Tensor, num_groups: int, eps: float = 1e-5) -> Tensor:
    """Group normalisation of ``t`` (N, C, ...): channels in ``num_groups`` groups, each
    normalised over its channels and the spatial axes, then scaled by ``weight`` (C,) and
    shifted by ``bias`` (C,)."""
    if t.rank < 2 or t.shape[1] % num_groups:
        raise ShapeMismatchError(f"op 'group_norm': {num_groups} groups do not divide the channels (axis 1) of "
                                 f"'{t.name}' {t.shape}", where=user_source_line(),
                                 fix="pick num_groups dividing the channel count")
    return emit("group_norm", F.group_norm, (t, int(num_groups), weight, bias, float(eps)))


def batch_norm_inference(t: Tensor, scale: Tensor, bias: Tensor, mean: Tensor, var: Tensor,
                         epsilon: float = 1e-5, momentum: float = 0.9) -> Tensor:
    """Batch normalisation of ``t`` (N, C, ...) with the running statistics ``mean`` and ``var``
    (C,): ``scale * (t - mean) / sqrt(var + epsilon) + bias``. ``momentum`` is unused (inference)."""
    return emit("batch_norm_inference", kernels.batch_norm_inference, (t, scale, bias, mean, var, float(epsilon)))
