"""PopXL dtype names, as plain ``torch.dtype`` objects.

ipuxl tensors carry torch dtypes directly (``ipuxl.float32 is torch.float32``), so a
graph is ordinary PyTorch code. This module adds PopXL's names and the numpy
conversions the host streams need.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "dtype", "float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
    "int64", "uint32", "bool", "to_numpy_dtype", "from_any", "dtype_name",
]

dtype = torch.dtype  # PopXL's ``popxl.dtype`` (the type of every dtype object)
float16 = torch.float16
bfloat16 = torch.bfloat16
float32 = torch.float32
float64 = torch.float64
int8 = torch.int8
uint8 = torch.uint8
int16 = torch.int16
int32 = torch.int32
int64 = torch.int64
uint32 = torch.uint32
bool = torch.bool  # noqa: A001 - PopXL's public name

_TO_NUMPY = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
    torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16,
    torch.int32: np.int32, torch.int64: np.int64, torch.uint32: np.uint32,
    torch.bool: np.bool_,
}
_FROM_NUMPY = {np.dtype(v): k for k, v in _TO_NUMPY.items()}
# PopXL's ``downcast=True``: 64-bit host data becomes 32-bit on the device.
DOWNCAST = {torch.float64: torch.float32, torch.int64: torch.int32}


def to_numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype that holds host data of ``dtype`` (bfloat16 uses float32)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.float32)
    return np.dtype(_TO_NUMPY[dtype])


def from_any(dtype: object) -> torch.dtype:
    """Turn a torch dtype, numpy dtype or PopXL-style name into a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype, None)
        if isinstance(found, torch.dtype):
            return found
        raise TypeError(f"unknown dtype name {dtype!r}; use e.g. ipuxl.float32")
    try:
        return _FROM_NUMPY[np.dtype(dtype)]
    except (TypeError, KeyError):
        raise TypeError(f"cannot interpret {dtype!r} as a dtype; use e.g. ipuxl.float32") from None


def dtype_name(dtype: torch.dtype) -> str:
    """PopXL's short name of a dtype (``float32``, not ``torch.float32``)."""
    return str(dtype).replace("torch.", "")
