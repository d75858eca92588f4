"""Arithmetic on unsigned integer tensors that torch's CPU kernels lack.

torch has no CPU ``add``/``sub``/``fmod`` for ``uint16``/``uint32`` (``"add_stub" not
implemented for 'UInt32'``), yet PopXL programs do arithmetic on uint32 seeds and
counters. These kernels compute in int64 and wrap modulo ``2**bits``, as the
IPU's unsigned arithmetic does.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["WIDENED", "add", "sub", "add_", "fmod", "is_widened"]

#: Unsigned dtypes computed in int64 (their values fit).
WIDENED = {torch.uint16: 16, torch.uint32: 32}


def is_widened(dtype: torch.dtype) -> bool:
    """True for the dtypes these kernels handle."""
    return dtype in WIDENED


def _result_dtype(a: Any, b: Any) -> torch.dtype:
    return next(v.dtype for v in (a, b) if isinstance(v, torch.Tensor) and v.dtype in WIDENED)


def _wide(v: Any) -> Any:
    return v.to(torch.int64) if isinstance(v, torch.Tensor) else v


def _wrap(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.remainder(value, 1 << WIDENED[dtype]).to(dtype)


def _binary(fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    def kernel(a: Any, b: Any) -> torch.Tensor:
        return _wrap(fn(_wide(a), _wide(b)), _result_dtype(a, b))

    kernel.__name__ = kernel.__qualname__ = f"{fn.__name__}_unsigned"
    return kernel


add = _binary(torch.add)
sub = _binary(torch.sub)
fmod = _binary(torch.fmod)


def add_(a: torch.Tensor, b: Any) -> torch.Tensor:
    """In-place ``a += b`` on an unsigned tensor (wrapping)."""
    return a.copy_(add(a, b))
