"""Kernels of ``ipuxl.ops.shape``: selections, gathers and one-hot encoding."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["select", "copy_getitem", "take", "gather_zero_oor", "onehot"]


def select(t: torch.Tensor, axis: int, indices: list[int]) -> torch.Tensor:
    """The entries ``indices`` (a static list) of ``t`` along ``axis``, in that order."""
    return torch.index_select(t, axis, torch.tensor(indices, device=t.device))


def copy_getitem(t: torch.Tensor, key: Any) -> torch.Tensor:
    """A copy of ``t[key]``."""
    return t[key].clone()


def take(t: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
    """``numpy.take(t, indices, axis)``: negative indices count from the end (``index_select``
    rejects them)."""
    indices = indices.long()
    indices = torch.where(indices < 0, indices + t.shape[axis], indices)
    flat = torch.index_select(t, axis, indices.reshape(-1))
    return flat.reshape(t.shape[:axis] + indices.shape + t.shape[axis + 1:])


def gather_zero_oor(t: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
    """``take`` with out-of-range indices giving zeros."""
    size = t.shape[axis]
    valid = (indices >= 0) & (indices < size)
    out = take(t, torch.where(valid, indices, 0), axis)
    mask = valid.reshape((1,) * axis + tuple(indices.shape) + (1,) * (t.dim() - axis - 1))
    return out * mask


def onehot(t: torch.Tensor, classes: int, axis: int, values: torch.Tensor | None) -> torch.Tensor:
    """ONNX OneHot with the class axis at ``axis``: ``values[1]`` at each index's class, else
    ``values[0]`` (float32 ones and zeros when ``values`` is None)."""
    index = t.long()
    index = torch.where(index < 0, index + classes, index)
    hot = index.unsqueeze(-1) == torch.arange(classes, device=t.device)
    if values is None:
        out = hot.to(torch.float32)
    else:
        out = torch.where(hot, values[1], values[0])
    return out.movedim(-1, axis)
