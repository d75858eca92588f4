"""Kernels of ``ipuxl.ops.indexing``: dynamic slices and updates, scatters, top-k, histogram.

Indices are tensors read on the device, so every kernel is plain tensor indexing (no
host round trip, no Python per element) and traces into the joint graph autodiff
differentiates.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["dynamic_slice", "dynamic_update", "scatter", "scatter_reduce", "topk", "histogram"]


def _grids(index: torch.Tensor, shape: Sequence[int], axes: list[int], sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """Broadcastable index tensors of the slice ``[index[i], index[i] + sizes[i])`` on ``axes``,
    each start clamped so that the slice fits in the axis."""
    starts = index.reshape(-1).long()
    grids = []
    for i, (axis, size) in enumerate(zip(axes, sizes)):
        start = starts[i].clamp(0, shape[axis] - size)
        view = [1] * len(axes)
        view[i] = size
        grids.append((start + torch.arange(size, device=index.device)).reshape(view))
    return tuple(grids)


def dynamic_slice(t: torch.Tensor, index: torch.Tensor, axes: list[int], sizes: list[int]) -> torch.Tensor:
    """A copy of the slice of ``t`` of ``sizes`` on ``axes`` starting at ``index`` (clamped to fit)."""
    front = list(range(len(axes)))
    return t.movedim(axes, front)[_grids(index, t.shape, axes, sizes)].movedim(front, axes)


def dynamic_update(t: torch.Tensor, index: torch.Tensor, update: torch.Tensor, axes: list[int], sizes: list[int],
                   in_place: bool) -> torch.Tensor:
    """``t`` with the slice at ``index`` (as in ``dynamic_slice``) set to ``update``: a new
    tensor, or ``t`` itself written in place when ``in_place``."""
    front = list(range(len(axes)))
    grids = _grids(index, t.shape, axes, sizes)
    values = update.to(t.dtype).movedim(axes, front)
    if in_place:
        t.movedim(axes, front).index_put_(grids, values)
        return t
    return t.movedim(axes, front).index_put(grids, values).movedim(front, axes)


def scatter(t: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, axis: int) -> torch.Tensor:
    """ONNX ScatterElements: a copy of ``t`` with ``values`` at ``indices`` on ``axis`` (negative
    indices count from the end)."""
    index = indices.long()
    index = torch.where(index < 0, index + t.shape[axis], index)
    return torch.scatter(t, axis, index, values.to(t.dtype))


_REDUCE = {"sum": "sum", "min": "amin", "max": "amax"}


def scatter_reduce(data: torch.Tensor, indices: torch.Tensor, initial: torch.Tensor | None, reduction: str,
                   axis: int, axis_size: int) -> torch.Tensor:
    """The slices of ``data`` reduced into ``axis_size`` entries on ``axis`` at ``indices``,
    starting from ``initial`` (included) or from zeros (not included)."""
    index = indices.long()
    if index.dim() == 1 and data.dim() > 1:  # one index per slice along axis
        index = index.reshape([-1 if d == axis else 1 for d in range(data.dim())])
    index = index.expand(data.shape)
    shape = list(data.shape)
    shape[axis] = axis_size
    base = initial.to(data.dtype) if initial is not None else torch.zeros(shape, dtype=data.dtype,
                                                                          device=data.device)
    if reduction == "none":
        return torch.scatter(base, axis, index, data)
    return base.scatter_reduce(axis, index, data, _REDUCE[reduction], include_self=initial is not None)


def topk(t: torch.Tensor, k: int, axis: int, largest: bool, sort: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk`` with int32 indices (PopXL's index type)."""
    values, indices = torch.topk(t, k, axis, largest, sort)
    return values, indices.to(torch.int32)


def histogram(t: torch.Tensor, levels: list[float], absolute: bool) -> torch.Tensor:
    """uint32 counts of ``t``'s elements (or their absolute values) in the ``len(levels) + 1``
    bins the increasing ``levels`` bound."""
    x = t.abs() if absolute else t
    edges = torch.tensor(levels, dtype=x.dtype, device=x.device)
    bins = torch.bucketize(x.reshape(-1), edges, right=True)
    counts = torch.zeros(len(levels) + 1, dtype=torch.int64, device=x.device)
    return counts.scatter_add_(0, bins, torch.ones_like(bins)).to(torch.uint32)
