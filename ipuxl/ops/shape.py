"""Ops that move data without arithmetic: reshape, transpose, slicing, gather, cast."""
from __future__ import annotations

import builtins
import math
import operator
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ipuxl.ir.aliases import storage_owner
from ipuxl.ir.build import emit
from ipuxl.dtypes import dtype_name, from_any
from ipuxl.errors import InvalidArgumentError, ShapeMismatchError, UnsupportedError
from ipuxl.ir.context import gcg, user_source_line
from ipuxl.ir.meta import MODIFIES, VIEW_OF
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import shape as kernels
from ipuxl.ops.elementwise import where

__all__ = [
    "reshape", "reshape_", "flatten", "flatten_", "transpose", "transpose_", "concat", "concat_", "split",
    "slice", "slice_", "squeeze", "unsqueeze", "subsample", "gather", "getitem", "cast", "detach", "detach_",
    "onehot", "identity", "diagonal",
]


def _alias(op_name: str, target: Any, args: tuple[Any, ...], t: Tensor, *, name: str | None = None,
           check_view: bool = True) -> Tensor:
    """Emit a PopXL in-place view op: its result *is* ``t``'s storage (PopXL's ``reshape_``,
    ``transpose_``...), so in-place writes through either are seen in the other.

    The result is recorded as an in-place result of ``t`` (``MODIFIES``) that writes
    nothing, so lowering never copies it (it copies plain views that are written).

    ``t`` may be the result of an out-of-place op that ipuxl computes as a view of its
    input (``transpose``): in PopXL that result is a tensor of its own, so a reshape of
    it is allowed; when its layout cannot be viewed so, the result is a reshaped copy
    (writes through it then do not reach ``t``, which nothing in PopXL code reads
    after reshaping it in place).
    """
    if check_view:
        probe = torch.empty_like(t.node.meta["val"], device="meta")
        out = target(probe, *args[1:])
        if out._base is not probe and VIEW_OF in t.node.meta:
            return emit(op_name, target, args, name=name)
        if out._base is not probe:
            raise ShapeMismatchError(
                f"op '{op_name}' of {t.name!r} {t.shape}: the result cannot share the input's storage "
                "(its memory layout is not contiguous, e.g. after transpose_)",
                where=user_source_line(),
                fix=f"use the out-of-place op ops.{op_name.rstrip('_')} (it returns a new tensor)")
    out_t = emit(op_name, target, args, name=name, aliases=t)
    out_t.node.meta.pop(VIEW_OF, None)
    out_t.node.meta[MODIFIES] = storage_owner(t.node, views=False)
    return out_t


def _check_shape(op_name: str, t: Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if any(d < -1 or d == 0 for d in shape):
        raise ShapeMismatchError(
            f"Invalid shape value in reshape. Must be '>0' or '-1'. Provided {shape} (op '{op_name}' of "
            f"'{t.name}' {t.shape})", where=user_source_line(), fix="use positive sizes and at most one -1")
    if shape.count(-1) > 1:
        raise ShapeMismatchError(
            f"Reshape shape can contain at most one '-1' value. Provided {shape} (op '{op_name}' of "
            f"'{t.name}' {t.shape})", where=user_source_line(), fix="use positive sizes and at most one -1")
    known = math.prod(d for d in shape if d != -1)
    if (-1 in shape and t.nelms % known) or (-1 not in shape and known != t.nelms):
        raise ShapeMismatchError(
            f"op '{op_name}' of '{t.name}' {t.shape} ({t.nelms} elements): cannot reshape to {shape}",
            where=user_source_line(), fix=f"give a shape with {t.nelms} elements")
    return shape


def reshape(t: Tensor, shape: Sequence[int]) -> Tensor:
    """Reshape ``t``; at most one dimension may be ``-1``.

    Raises:
        ShapeMismatchError (a ValueError, as in PopXL): a size is 0 or below -1, more
            than one is -1, or the element count differs.
    """
    shape = _check_shape("reshape", t, shape)
    return emit("reshape", torch.reshape, (t, shape), name=f"{t.name}_reshaped")


def reshape_(t: Tensor, shape: Sequence[int]) -> Tensor:
    """In-place ``reshape``: the result is an alias of ``t`` (writes to one are seen in the other)."""
    shape = _check_shape("reshape_", t, shape)
    return _alias("reshape_", torch.reshape, (t, shape), t, name=f"{t.name}_reshaped")


def flatten(t: Tensor) -> Tensor:
    """Reshape ``t`` to one dimension (PopXL's ``flatten``)."""
    return reshape(t, (-1,))


def flatten_(t: Tensor) -> Tensor:
    """In-place ``flatten``: an alias of ``t`` with one dimension."""
    return reshape_(t, (-1,))


def _permutation(op_name: str, t: Tensor, permutation: Sequence[int] | None) -> tuple[int, ...]:
    perm = tuple(permutation) if permutation is not None else tuple(reversed(range(t.rank)))
    if sorted(p % t.rank if -t.rank <= p < t.rank else p for p in perm) != list(range(t.rank)):
        raise ShapeMismatchError(
            f"op '{op_name}' of '{t.name}' {t.shape}: {perm} is not a permutation of the axes 0..{t.rank - 1}",
            where=user_source_line(), fix=f"give each axis in [0, {t.rank}) exactly once")
    return perm


def transpose(t: Tensor, permutation: Sequence[int] | None = None) -> Tensor:
    """Permute the axes of ``t``; by default reverse them."""
    perm = _permutation("transpose", t, permutation)
    return emit("transpose", torch.permute, (t, perm), name=f"{t.name}_T")


def transpose_(t: Tensor, permutation: Sequence[int] | None = None) -> Tensor:
    """In-place ``transpose``: an alias of ``t`` with permuted axes."""
    perm = _permutation("transpose_", t, permutation)
    return _alias("transpose_", torch.permute, (t, perm), t, name=f"{t.name}_T")


def concat(ts: Iterable[Tensor], axis: int = 0) -> Tensor:
    """Concatenate tensors along ``axis``.

    Raises:
        InvalidArgumentError: the tensors' dtypes differ (PopXL's TypeError; cast them first).
    """
    ts = list(ts)
    _same_dtypes(ts)
    return emit("concat", torch.cat, (ts, axis))


def _same_dtypes(ts: list[Tensor]) -> None:
    dtypes = [t.dtype for t in ts if isinstance(t, Tensor)]
    if len(set(dtypes)) > 1:
        raise InvalidArgumentError(
            f"All inputs to a concat operation must have the same type: [{', '.join(dtype_name(d) for d in dtypes)}]",
            where=user_source_line(), fix="ops.cast the inputs to one dtype first")


def concat_(ts: Iterable[Tensor], axis: int = 0) -> Tensor:
    """PopXL's ``concat_``, whose result aliases every input.

    Differs from PopXL: torch storage cannot alias several tensors, so the result is
    a new tensor (as ``concat``); in-place writes to it do not reach the inputs.

    Raises:
        InvalidArgumentError: the tensors' dtypes differ (PopXL's TypeError).
    """
    ts = list(ts)
    _same_dtypes(ts)
    return emit("concat_", torch.cat, (ts, axis))


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


def _slice_key(t: Tensor, start: Any, stop: Any, step: Any, axis: Any) -> list[Any]:
    lists = [v if isinstance(v, (list, tuple)) else None if v is None else [v] for v in (start, stop, step, axis)]
    n = builtins.max(len(v) for v in lists if v is not None)
    start_l, stop_l, step_l, axis_l = (v if v is not None else [None] * n for v in lists)
    if axis is None:
        axis_l = list(range(n))
    key: list[Any] = [builtins.slice(None)] * t.rank
    for a, s0, s1, st in zip(axis_l, start_l, stop_l, step_l):
        key[a] = builtins.slice(s0, s1, st)
    return key


def slice(t: Tensor, start: Any = None, stop: Any = None, step: Any = None, axis: Any = None) -> Tensor:  # noqa: A001
    """PopXL's ``slice``: per-axis ``start:stop:step`` (ONNX Slice semantics)."""
    if start is None and stop is None and step is None:
        return t
    key = _slice_key(t, start, stop, step, axis)
    if any(k.step is not None and k.step < 0 for k in key):
        return _negative_step_slice(t, key)
    return emit("slice", operator.getitem, (t, tuple(key)))


def slice_(t: Tensor, start: Any = None, stop: Any = None, step: Any = None, axis: Any = None) -> Tensor:
    """In-place ``slice``: an alias of the selected part of ``t``.

    Differs from PopXL: a negative ``step`` is refused (torch views cannot run backwards).
    """
    if start is None and stop is None and step is None:
        return t
    key = _slice_key(t, start, stop, step, axis)
    if any(k.step is not None and k.step < 0 for k in key):
        raise UnsupportedError(
            f"op 'slice_' of '{t.name}': a negative step cannot give an in-place view",
            where=user_source_line(), fix="use ops.slice (it returns a new tensor) for backward slices")
    return _alias("slice_", operator.getitem, (t, tuple(key)), t)


def _negative_step_slice(t: Tensor, key: list[Any]) -> Tensor:
    # Shapes are static, so Python's own slicing gives the exact indices per axis.
    out = t
    for axis, k in enumerate(key):
        if k.step is not None and k.step < 0:
            out = emit("slice", kernels.select, (out, axis, list(range(t.shape[axis]))[k]))
        elif k != builtins.slice(None):
            index: list[Any] = [builtins.slice(None)] * t.rank
            index[axis] = k
            out = emit("slice", operator.getitem, (out, tuple(index)))
    return out


def squeeze(t: Tensor, axes: list[int] | None = None) -> Tensor:
    """Remove size-1 dimensions (all, or those in ``axes``; negative axes count from the back).

    Raises:
        ShapeMismatchError (a ValueError, as in PopXL): an axis is out of range,
            repeated, or not of size 1.
    """
    if axes is None:
        axes = [i for i, d in enumerate(t.shape) if d == 1]
    out_of_range = [a for a in axes if not -t.rank <= a < max(t.rank, 1)]
    if out_of_range:
        raise ShapeMismatchError(f"op 'squeeze' of '{t.name}' {t.shape}: axes {out_of_range} are out of range",
                                 where=user_source_line(), fix=f"give axes in [{-t.rank}, {t.rank - 1}]")
    axes = [a % t.rank for a in axes] if t.rank else []
    if len(set(axes)) != len(axes):
        raise ShapeMismatchError(f"op 'squeeze' of '{t.name}': axes {axes} contain duplicates",
                                 where=user_source_line(), fix="give each axis once")
    bad = [a for a in axes if t.shape[a] != 1]
    if bad:
        raise ShapeMismatchError(f"op 'squeeze' of '{t.name}' {t.shape}: axes {bad} are not of size 1",
                                 where=user_source_line(), fix="squeeze only size-1 axes")
    return emit("squeeze", torch.squeeze, (t, tuple(axes)))


def subsample(t: Tensor, strides: int | Sequence[int]) -> Tensor:
    """Every ``strides[i]``-th element along axis ``i``, starting at 0 (PopXL's ``subsample``)."""
    strides = [int(strides)] if isinstance(strides, int) else [int(s) for s in strides]
    if len(strides) != t.rank or any(s < 1 for s in strides):
        raise ShapeMismatchError(
            f"op 'subsample' of '{t.name}' {t.shape}: strides {strides} need one positive stride per axis",
            where=user_source_line(), fix=f"give {t.rank} strides, each >= 1")
    key = tuple(builtins.slice(None, None, s) for s in strides)
    return emit("subsample", kernels.copy_getitem, (t, key))


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
        return emit("gather", kernels.gather_zero_oor, (t, indices, axis))
    return emit("gather", kernels.take, (t, indices, axis))


def getitem(t: Tensor, key: Any) -> Tensor:
    """PopXL's ``Tensor.__getitem__``: ints/slices slice, int tensors gather, bool tensors mask."""
    if isinstance(key, (np.ndarray, torch.Tensor, list)) and not isinstance(key, Tensor):
        key = _host_index(t, key)  # host arrays and sequences: a constant index tensor (PopXL's)
    if isinstance(key, Tensor):
        if key.dtype == torch.bool:
            return where(key, t, 0)
        if key.dtype.is_floating_point:
            raise InvalidArgumentError(
                f"cannot index tensor '{t.name}' with the {dtype_name(key.dtype)} tensor '{key.name}'",
                where=user_source_line(), fix="index with an integer tensor (gather) or a boolean tensor (mask)")
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


def _host_index(t: Tensor, key: Any) -> Tensor:
    from ipuxl.ir.graph_builder import constant  # graph_builder imports ops' modules: bind late

    try:
        return constant(key)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"cannot index tensor '{t.name}' with {key!r}: {error}", where=user_source_line(),
                                   fix="use integers, slices (`:`), integer tensors or boolean tensors") from error


def diagonal(t: Tensor) -> Tensor:
    """The main diagonal of a 2-D ``t`` (``Tensor.diag``), a new tensor of ``min(t.shape)`` elements."""
    return emit("diag", torch.diag, (t,))


def cast(t: Tensor, data_type: torch.dtype) -> Tensor:
    """Convert ``t`` to ``data_type``."""
    return emit("cast", torch.Tensor.to, (t, from_any(data_type)))


def detach(t: Tensor) -> Tensor:
    """Identity whose gradient is zero (stops autodiff)."""
    return emit("detach", torch.Tensor.detach, (t,), aliases=t)


def detach_(t: Tensor) -> Tensor:
    """In-place ``detach``: an alias of ``t`` through which no gradient flows."""
    return _alias("detach_", torch.Tensor.detach, (t,), t, check_view=False)


def identity(t: Tensor, output_name: str | None = None) -> Tensor:
    """A copy of ``t``, named ``output_name`` (default ``identity_<name>``; renames a tensor)."""
    return emit("identity", torch.clone, (t,), name=output_name or f"identity_{t.name}")


def onehot(t: Tensor, num_classes: Tensor | int, values: Tensor | None = None, axis: int = -1) -> Tensor:
    """ONNX OneHot: ``values[1]`` where the class is ``t``'s index, else ``values[0]``.

    Args:
        t: integer indices (negative ones count from ``num_classes``; others out of
            range give an all-``values[0]`` row).
        num_classes: the number of classes: a scalar constant tensor (as in PopXL) or an int.
        values: ``[off, on]``; its dtype is the result's. Default (ipuxl): float32 ``[0, 1]``.
        axis: where the new class axis goes in the output (negative counts from the back).
    """
    classes = _static_int("onehot", num_classes)
    rank = t.rank + 1
    if not -rank <= axis < rank:
        raise ShapeMismatchError(f"op 'onehot': axis {axis} is out of range for an output of rank {rank}",
                                 where=user_source_line(), fix=f"give an axis in [{-rank}, {rank - 1}]")
    if values is None:
        return emit("onehot", kernels.onehot, (t, classes, axis % rank, None))
    return emit("onehot", kernels.onehot, (t, classes, axis % rank, values))


def _static_int(op_name: str, value: Tensor | int) -> int:
    """An int given as a Python int or a scalar constant tensor (its value is known now)."""
    if not isinstance(value, Tensor):
        return int(value)
    target = value.node.target
    constant = gcg().constant_data.get(target) if isinstance(target, str) and value.node.op == "get_attr" else None
    if constant is None or constant.numel() != 1:
        raise InvalidArgumentError(
            f"op '{op_name}': {value.name!r} must be a scalar constant (its value sets the output shape)",
            where=user_source_line(), fix="pass ipuxl.constant(n) or a Python int")
    return int(constant.reshape(()).item())
