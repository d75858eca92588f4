"""Indexing ops with runtime indices: dynamic slices and updates, scatters, top-k, histogram.

PopXL names and semantics (ONNX where PopXL follows it). Indices are tensors read on
the device, so every kernel (``ipuxl.kernels.indexing``) is plain tensor indexing (no
host round trip, no Python per element) and traces into the joint graph autodiff
differentiates.
"""
from __future__ import annotations

import builtins
from typing import Iterable, Literal

from ipuxl.errors import ShapeMismatchError
from ipuxl.ir.build import emit
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import indexing as kernels
from ipuxl.ops.shape import gather

__all__ = ["dynamic_slice", "dynamic_update", "dynamic_update_", "scatter", "scatter_reduce", "topk",
           "tied_gather", "histogram", "ScatterReductionType"]

ScatterReductionType = Literal["sum", "min", "max", "none"]


# -- dynamic slice / update ---------------------------------------------------------------------
def _check_dynamic(op_name: str, t: Tensor, index: Tensor, axes: Iterable[int],
                   sizes: Iterable[int]) -> tuple[list[int], list[int]]:
    axes_l = [int(a) % builtins.max(t.rank, 1) if -t.rank <= int(a) < t.rank else int(a) for a in axes]
    sizes_l = [int(s) for s in sizes]
    problem = None
    if len(axes_l) != len(sizes_l) or len(set(axes_l)) != len(axes_l):
        problem = f"axes {axes_l} and sizes {sizes_l} must be of one length, each axis once"
    elif any(not 0 <= a < t.rank for a in axes_l):
        problem = f"axes {axes_l} are out of range for rank {t.rank}"
    elif any(not 0 < s <= t.shape[a] for a, s in zip(axes_l, sizes_l)):
        problem = f"sizes {sizes_l} must be in [1, axis length] for axes {axes_l} of shape {t.shape}"
    elif index.shape not in ((len(axes_l),), ()) or index.spec.dtype.is_floating_point:
        problem = f"index '{index.name}' must be an integer tensor of shape ({len(axes_l)},), got {index.shape}"
    if problem:
        raise ShapeMismatchError(f"op '{op_name}' of '{t.name}': {problem}", where=user_source_line(),
                                 fix="give one integer start per axis in `index`, and one size per axis")
    return axes_l, sizes_l


def dynamic_slice(t: Tensor, index: Tensor, axes: list[int], sizes: list[int], no_overlap: bool) -> Tensor:
    """A copy of ``t[index[0]:index[0]+sizes[0], ...]`` on ``axes``, ``index`` read at run time.

    A start that would run past the end of its axis is clamped to ``length - size``
    (PopXL leaves that case undefined). ``no_overlap`` is accepted (a gradient hint).
    """
    axes_l, sizes_l = _check_dynamic("dynamic_slice", t, index, axes, sizes)
    return emit("dynamic_slice", kernels.dynamic_slice, (t, index, axes_l, sizes_l))


def _check_update(op_name: str, t: Tensor, t_update: Tensor, axes: list[int], sizes: list[int]) -> None:
    expected = tuple(sizes[axes.index(a)] if a in axes else d for a, d in enumerate(t.shape))
    if t_update.shape != expected:
        raise ShapeMismatchError(f"op '{op_name}': update '{t_update.name}' has shape {t_update.shape}, the slice "
                                 f"of '{t.name}' {t.shape} has {expected}", where=user_source_line(),
                                 fix="make the update the shape of the slice (sizes on axes, the rest unchanged)")


def dynamic_update(t: Tensor, index: Tensor, t_update: Tensor, axes: Iterable[int], sizes: Iterable[int],
                   no_overlap: bool) -> Tensor:
    """A copy of ``t`` whose slice at ``index`` (as in ``dynamic_slice``) is ``t_update``."""
    axes_l, sizes_l = _check_dynamic("dynamic_update", t, index, axes, sizes)
    _check_update("dynamic_update", t, t_update, axes_l, sizes_l)
    return emit("dynamic_update", kernels.dynamic_update, (t, index, t_update, axes_l, sizes_l, False))


def dynamic_update_(t: Tensor, index: Tensor, t_update: Tensor, axes: Iterable[int], sizes: Iterable[int],
                    no_overlap: bool) -> Tensor:
    """In-place ``dynamic_update``: writes the slice of ``t`` and returns ``t``."""
    axes_l, sizes_l = _check_dynamic("dynamic_update_", t, index, axes, sizes)
    _check_update("dynamic_update_", t, t_update, axes_l, sizes_l)
    return emit("dynamic_update_", kernels.dynamic_update, (t, index, t_update, axes_l, sizes_l, True), modifies=t)


# -- scatter --------------------------------------------------------------------------------------
def scatter(t: Tensor, indices: Tensor, values: Tensor, axis: int = 0,
            available_memory_proportion: float | None = None) -> Tensor:
    """ONNX Scatter(Elements): a copy of ``t`` with ``out[..., indices[i, j], ...] = values[i, j]``
    (the index replaces the position on ``axis``). ``indices`` and ``values`` have one shape
    and ``t``'s rank; negative indices count from the end; duplicates leave any one value."""
    if indices.shape != values.shape or indices.rank != t.rank:
        raise ShapeMismatchError(f"op 'scatter': indices {indices.shape} and values {values.shape} must have one "
                                 f"shape of the rank of '{t.name}' {t.shape}", where=user_source_line(),
                                 fix="reshape indices and values to t's rank")
    return emit("scatter", kernels.scatter, (t, indices, values, axis % builtins.max(t.rank, 1)))


def scatter_reduce(data: Tensor, indices: Tensor, reduction: ScatterReductionType,
                   initial_values: Tensor | None = None, axis: int = 0, axis_size: int | None = None,
                   available_memory_proportion: float | None = None) -> Tensor:
    """Reduce the slices of ``data`` into ``out[indices[i]]`` along ``axis``
    (``out`` has ``axis_size`` entries there; PopXL's ``scatter_reduce``).

    ``indices`` has ``data``'s shape, or is 1-D with one index per slice. ``out``
    starts from ``initial_values`` (included in the reduction), else from zeros that
    are not (entries no index reaches are 0). ``reduction``: sum, min, max or none
    (a plain scatter).
    """
    if initial_values is None and axis_size is None:
        raise ShapeMismatchError("op 'scatter_reduce': one of initial_values and axis_size must be specified",
                                 where=user_source_line(), fix="pass axis_size= (the output length on axis)")
    if reduction not in ("sum", "min", "max", "none"):
        raise ShapeMismatchError(f"op 'scatter_reduce': the reduction must be one of sum, min, max, none, "
                                 f"got {reduction!r}", where=user_source_line(), fix="pick one of those")
    axis = axis % builtins.max(data.rank, 1)
    size = int(axis_size) if axis_size is not None else initial_values.shape[axis]  # type: ignore[union-attr]
    return emit("scatter_reduce", kernels.scatter_reduce, (data, indices, initial_values, reduction, axis, size))


# -- top-k, tied gather, histogram ----------------------------------------------------------------
def topk(t: Tensor, k: int, axis: int, largest: bool, sorted: bool) -> tuple[Tensor, Tensor]:  # noqa: A002
    """The ``k`` largest (or smallest) elements along ``axis`` and their int32 indices
    (ONNX TopK); ``sorted`` orders them largest-first (smallest-first)."""
    if not -t.rank <= axis < builtins.max(t.rank, 1) or not 0 < k <= (t.shape[axis] if t.rank else 1):
        raise ShapeMismatchError(f"op 'topk' of '{t.name}' {t.shape}: k={k} on axis {axis} is out of range",
                                 where=user_source_line(), fix="give 0 < k <= the axis length")
    values, indices = emit("topk", kernels.topk, (t, int(k), axis, bool(largest), bool(sorted)), num_outputs=2)
    return values, indices


def tied_gather(t: Tensor, indices: Tensor, axis: int = 0, available_memory_proportion: float | None = None,
                zero_OOR: bool = False) -> Tensor:  # noqa: N803
    """``gather`` (``numpy.take``); on the IPU its tile layout follows a tied ``matmul``.
    Numerically identical to ``gather``, gradient included."""
    return gather(t, indices, axis, available_memory_proportion, zero_OOR)


def histogram(t: Tensor, levels: list[float], absolute_of_input: bool) -> Tensor:
    """Counts (uint32, ``len(levels) + 1`` bins) of ``t``'s elements: bin 0 below
    ``levels[0]``, bin ``i`` in ``[levels[i-1], levels[i])``, the last at or above ``levels[-1]``.

    Raises:
        ShapeMismatchError (a ValueError, as in PopXL): ``levels`` is not increasing.
    """
    levels = [float(v) for v in levels]
    if any(a >= b for a, b in zip(levels, levels[1:])) or not levels:
        raise ShapeMismatchError(f"op 'histogram': the levels {levels} are not a monotonically increasing list",
                                 where=user_source_line(), fix="sort the bin edges and drop duplicates")
    return emit("histogram", kernels.histogram, (t, levels, bool(absolute_of_input)))
