"""Kernels of ``ipuxl.ops.reduce`` that torch has no single function for."""
from __future__ import annotations

import torch

__all__ = ["prod", "sumsquare", "argmax", "argmin", "lamb_square", "logsum", "median", "cumsum"]


def prod(t: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """The product over ``dims``, one axis at a time."""
    for d in sorted((d % t.dim() for d in dims), reverse=True):
        t = torch.prod(t, d, keepdim=keepdim)
    return t


def sumsquare(t: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """The sum of squares over ``dims``."""
    return torch.sum(t * t, dims, keepdim)


def argmax(t: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
    """``torch.argmax`` as int32 (PopXL's index type)."""
    return torch.argmax(t, dim, keepdim).to(torch.int32)


def argmin(t: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
    """``torch.argmin`` as int32 (PopXL's index type)."""
    return torch.argmin(t, dim, keepdim).to(torch.int32)


def lamb_square(t: torch.Tensor) -> torch.Tensor:
    """The sum of squares of all elements, computed in float32."""
    t32 = t.float()
    return torch.sum(t32 * t32)


def logsum(t: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """``log(sum(t))`` over ``dims``."""
    return torch.log(torch.sum(t, dims, keepdim))


def median(t: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """The median over ``dims`` (the lower middle value for an even count)."""
    kept = [d for d in range(t.dim()) if d not in dims]
    moved = t.permute(*kept, *dims).reshape(*(t.shape[d] for d in kept), -1)
    out = torch.median(moved, dim=-1).values
    if keepdim:
        out = out.reshape([1 if d in dims else t.shape[d] for d in range(t.dim())])
    return out


def cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The cumulative sum along ``dim`` in ``t``'s dtype."""
    return torch.cumsum(t, dim, dtype=t.dtype)
