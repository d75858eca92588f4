"""popxl.addons' ``grad_reduce_square_add``: the sum of squares of a loss-scaled gradient."""
from __future__ import annotations

import torch

from ipuxl.dtypes import float32
from ipuxl.ir.build import emit
from ipuxl.ir.graph_builder import constant
from ipuxl.ir.tensor import Tensor

__all__ = ["grad_reduce_square_add"]


def grad_reduce_square_add(t: Tensor, loss_scaling: int | float | Tensor) -> Tensor:
    """``sum(t ** 2) / loss_scaling ** 2`` in float32, a scalar: the squared norm of a gradient
    that was computed with loss scaling.

    Example:
        >>> grad_norm = ops.sqrt(grad_reduce_square_add(grad, loss_scaling=64))
    """
    scale = 1 / (loss_scaling * loss_scaling)
    if not isinstance(scale, Tensor):
        scale = constant(scale, float32)
    return emit("grad_reduce_square_add", _reduce_square_add, (t, scale), name="grad_reduced")


def _reduce_square_add(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1).to(torch.float32)
    return (flat * flat).sum() * scale.to(torch.float32)
