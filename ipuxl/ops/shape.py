"""Ops that move data without arithmetic: reshape, transpose, slicing, gather, cast."""
from __future__ import annotations

import builtins
import operator
from typing import Any, Iterable, Sequence

import torch

from ipuxl.ir.build import emit
from ipuxl.dtypes import from_any
from ipuxl.errors import InvalidArgumentError, ShapeMismatchError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.ops.elementwise import where

__all__ = [
    "reshape", "flatten", "transpose", "concat", "split", "slice", "squeeze", "unsqueeze",
    "gather", "getitem", "cast", "detach", "onehot", "identity",
]


def reshape(t: Tensor, shape: Sequence[int]) -> Tensor:
    """Reshape ``t``; at most one dimension may be ``-1``."""
    shape = tuple(int(d) for d in shape)
    if builtins.sum(d == -1 for d in shape) > 1 or any(d < -1 or d == 0 for d in shape):
        raise ShapeMismatchError(
            f"op 'reshape' of '{t.name}' {t.shape}: invalid target shape {shape}",
            where=user_source_line(), fix="use positive sizes and at most one -1")
    return emit("reshape", torch.reshape, (t, shape), name=f"{t.name}_reshaped")


def flatten(t: Tensor) -> Tensor:
    """Reshape ``t`` to one dimension (PopXL's ``flatten``)."""
    return reshape(t, (-1,))


def transpose(t: Tensor, permutation: Sequence[int] | None = None) -> Tensor:
    """Permute the axes of ``t``; by default reverse them."""
    perm = tuple(permutation) if permutation is not None else tuple(reversed(range(t.rank)))
    return emit("transpose", torch.permute, (t, perm), name=f"{t.name}_T")


def concat(ts: Iterable[Tensor], axis: int = 0) -> Tensor:
    """Concatenate tensors along ``axis``."""
    return emit("concat", torch.cat, (list(ts), axis))


def split(t: Tensor, splits: int | list[int], axis: int = 0) -> list[Tensor]:
    """Split ``t`` along ``axis`` into ``splits`` equal parts or parts of the given sizes."""
    length = t.shape[axis]
    if isinstance(splits, int):
        if length % splits:
            raise ShapeMismatchError(
                f"op 'split': {splits} does not equally divide axis {axis} of '{t.name}' (length {length})",
                where=user_source_line(), fix="give a list of part sizes instead")
        sizes = [length // splits] * splits
    else:
        sizes = list(splits)
    return list(emit("split", torch.split, (t, sizes, axis), num_outputs=len(sizes), name=f"{t.name}_split"))


def slice(t: Tensor, start: Any = None, stop: Any = None, step: Any = None, axis: Any = None) -> Tensor:  # noqa: A001
    """PopXL's ``slice``: per-axis ``start:stop:step`` (ONNX Slice semantics)."""
    if start is None and stop is None and step is None:
        return t
    lists = [v if isinstance(v, (list, tuple)) else None if v is None else [v] for v in (start, stop, step, axis)]
    n = builtins.max(len(v) for v in lists if v is not None)
    start_l, stop_l, step_l, axis_l = (v if v is not None else [None] * n for v in lists)
    if axis is None:
        axis_l = list(range(n))
    key: list[Any] = [builtins.slice(None)] * t.rank
    for a, s0, s1, st in zip(axis_l, start_l, stop_l, step_l):
        key[a] = builtins.slice(s0, s1, st)
    if any(k.step is not None and k.step < 0 for k in key):
        return _negative_step_slice(t, key)
    return emit("slice", operator.getitem, (t, tuple(key)))


def _negative_step_slice(t: Tensor, key: list[Any]) -> Tensor:
    # Shapes are static, so Python's own slicing gives the exact indices per axis.
    out = t
    for axis, k in enumerate(key):
        if k.step is not None and k.step < 0:
            out = emit("slice", _select, (out, axis, list(range(t.shape[axis]))[k]))
        elif k != builtins.slice(None):
            index: list[Any] = [builtins.slice(None)] * t.rank
            index[axis] = k
            out = emit("slice", operator.getitem, (out, tuple(index)))
    return out


def _select(t: torch.Tensor, axis: int, indices: list[int]) -> torch.Tensor:
    return torch.index_select(t, axis, torch.tensor(indices, device=t.device))


def squeeze(t: Tensor, axes: list[int] | None = None) -> Tensor:
    """Remove size-1 dimensions (all, or those in ``axes``)."""
    if axes is None:
        axes = [i for i, d in enumerate(t.shape) if d == 1]
    bad = [a for a in axes if t.shape[a] != 1]
    if bad:
        raise ShapeMismatchError(f"op 'squeeze' of '{t.name}' {t.shape}: axes {bad} are not of size 1",
                                 where=user_source_line(), fix="squeeze only size-1 axes")
    return emit("squeeze", torch.squeeze, (t, tuple(axes)))


def unsqueeze(t: Tensor, axes: int | list[int]) -> Tensor:
    """Insert size-1 dimensions at ``axes``.

    As in ONNX/PopXL, ``axes`` are positions in the output; a negative axis counts
    from the back of the output (rank ``t.rank + len(axes)``).
    """
    axes = [axes] if isinstance(axes, int) else list(axes)
    rank = t.rank + len(axes)
    bad = [a for a in axes if not -rank <= a < rank]
    if bad or len({a % rank for a in axes}) != len(axes):
        raise ShapeMismatchError(f"op 'unsqueeze' of '{t.name}' {t.shape}: invalid or repeated axes {axes}",
                                 where=user_source_line(), fix=f"give distinct axes in [{-rank}, {rank - 1}]")
    shape = list(t.shape)
    for a in sorted(a % rank for a in axes):
        shape.insert(a, 1)
    return emit("unsqueeze", torch.reshape, (t, tuple(shape)))


def gather(t: Tensor, indices: Tensor, axis: int = 0, available_memory_proportion: float | None = None,
           zero_OOR: bool = False) -> Tensor:  # noqa: N803
    """``numpy.take(t, indices, axis)``; with ``zero_OOR`` out-of-range indices give 0."""
    axis = axis + t.rank if -t.rank <= axis < 0 else axis
    if zero_OOR:
        return emit("gather", _gather_zero_oor, (t, indices, axis))
    return emit("gather", _take, (t, indices, axis))


def _take(t: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
    # numpy.take: negative indices count from the end (index_select rejects them).
    indices = indices.long()
    indices = torch.where(indices < 0, indices + t.shape[axis], indices)
    flat = torch.index_select(t, axis, indices.reshape(-1))
    return flat.reshape(t.shape[:axis] + indices.shape + t.shape[axis + 1:])


def _gather_zero_oor(t: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
    size = t.shape[axis]
    valid = (indices >= 0) & (indices < size)
    out = _take(t, torch.where(valid, indices, 0), axis)
    mask = valid.reshape((1,) * axis + tuple(indices.shape) + (1,) * (t.dim() - axis - 1))
    return out * mask


def getitem(t: Tensor, key: Any) -> Tensor:
    """PopXL's ``Tensor.__getitem__``: ints/slices slice, int tensors gather, bool tensors mask."""
    if isinstance(key, Tensor):
        if key.dtype == torch.bool:
            return where(key, t, 0)
        return gather(t, key)
    keys = key if isinstance(key, tuple) else (key,)
    if not all(isinstance(k, (int, builtins.slice)) and not isinstance(k, bool) for k in keys):
        raise InvalidArgumentError(
            f"cannot index tensor '{t.name}' with {key!r}",
            where=user_source_line(),
            fix="use integers, slices (`:`), integer tensors or boolean tensors")
    if any(isinstance(k, builtins.slice) and k.step is not None and k.step < 0 for k in keys):
        sliced = slice(t, [k.start if isinstance(k, builtins.slice) else k for k in keys],
                       [k.stop if isinstance(k, builtins.slice) else (k + 1 or None) for k in keys],
                       [k.step if isinstance(k, builtins.slice) else 1 for k in keys])
        return squeeze(sliced, [i for i, k in enumerate(keys) if isinstance(k, int)])
    return emit("slice", operator.getitem, (t, keys))


def cast(t: Tensor, data_type: torch.dtype) -> Tensor:
    """Convert ``t`` to ``data_type``."""
    return emit("cast", torch.Tensor.to, (t, from_any(data_type)))


def detach(t: Tensor) -> Tensor:
    """Identity whose gradient is zero (stops autodiff)."""
    return emit("detach", torch.Tensor.detach, (t,), aliases=t)


def identity(t: Tensor) -> Tensor:
    """A copy of ``t``."""
    return emit("identity", torch.clone, (t,))


def onehot(t: Tensor, num_classes: int) -> Tensor:
    """One-hot encode integer ``t`` along a new last axis (float32 0/1)."""
    return emit("onehot", _onehot, (t, num_classes))


def _onehot(t: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(t.long(), num_classes).to(torch.float32)
