"""Reductions. PopXL names (``sum``, ``mean``, ``max``...) and ``reduce_*`` aliases."""
from __future__ import annotations

import builtins
from typing import Iterable

import torch

from ipuxl.ir.build import emit
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import reduce as kernels

__all__ = [
    "sum", "mean", "max", "min", "prod", "sumsquare", "logsumexp", "l1", "l2",
    "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "argmax", "argmin", "lamb_square",
    "logsum", "median", "cumsum",
]

Axis = int | Iterable[int] | None


def _dims(t: Tensor, axis: Axis) -> list[int]:
    if axis is None:
        return list(range(t.rank))
    return [axis] if isinstance(axis, int) else list(axis)


def sum(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``axis`` (all axes when None)."""
    return emit("sum", torch.sum, (t, _dims(t, axis), keepdims))


def mean(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis`` (all axes when None)."""
    return emit("mean", torch.mean, (t, _dims(t, axis), keepdims))


def max(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Maximum over ``axis`` (all axes when None)."""
    return emit("max", torch.amax, (t, _dims(t, axis), keepdims))


def min(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Minimum over ``axis`` (all axes when None)."""
    return emit("min", torch.amin, (t, _dims(t, axis), keepdims))


def prod(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Product over ``axis`` (all axes when None)."""
    return emit("prod", kernels.prod, (t, _dims(t, axis), keepdims))


def sumsquare(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Sum of squares over ``axis``."""
    return emit("sumsquare", kernels.sumsquare, (t, _dims(t, axis), keepdims))


def logsumexp(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """``log(sum(exp(t)))`` over ``axis``, computed stably."""
    return emit("logsumexp", torch.logsumexp, (t, _dims(t, axis), keepdims))


def l1(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Sum of absolute values over ``axis``."""
    return emit("l1", torch.linalg.vector_norm, (t, 1, _dims(t, axis), keepdims))


def l2(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Euclidean norm over ``axis``."""
    return emit("l2", torch.linalg.vector_norm, (t, 2, _dims(t, axis), keepdims))


def argmax(t: Tensor, dim: int = 0, keepdim: bool = False) -> Tensor:
    """Index of the maximum along ``dim`` (int32, as in PopXL)."""
    return emit("argmax", kernels.argmax, (t, dim, keepdim))


def argmin(t: Tensor, dim: int = 0, keepdim: bool = False) -> Tensor:
    """Index of the minimum along ``dim`` (int32, as in PopXL)."""
    return emit("argmin", kernels.argmin, (t, dim, keepdim))


def lamb_square(t: Tensor) -> Tensor:
    """Sum of squares of all elements, in float32 (LAMB's squared norms)."""
    return emit("lamb_square", kernels.lamb_square, (t,))


def logsum(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """``log(sum(t))`` over ``axis`` (all axes when None; ONNX ReduceLogSum)."""
    return emit("logsum", kernels.logsum, (t, _dims(t, axis), keepdims))


def median(t: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Median over ``axis`` (all axes when None): an element of ``t``, the lower of the two
    middle values for an even count (as PopART and ``torch.median``, unlike ``numpy.median``).
    The gradient goes to the element chosen."""
    dims = sorted(d % builtins.max(t.rank, 1) for d in _dims(t, axis))
    return emit("median", kernels.median, (t, dims, keepdims))


def cumsum(t: Tensor, dim: int = 0) -> Tensor:
    """Cumulative sum of ``t`` along ``dim``, in ``t``'s dtype (``torch.cumsum`` would widen integers)."""
    return emit("cumsum", kernels.cumsum, (t, dim))


reduce_sum = sum
reduce_mean = mean
reduce_max = max
reduce_min = min
