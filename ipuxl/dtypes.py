"""PopXL dtype names, as plain ``torch.dtype`` objects.

ipuxl tensors carry torch dtypes directly (``ipuxl.float32 is torch.float32``), so a
graph is ordinary PyTorch code. This module adds PopXL's names and the numpy
conversions the host streams need.
"""
from __future__ import annotations

import builtins
from typing import NoReturn

import numpy as np
import torch

__all__ = [
    "dtype", "float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
    "int64", "uint32", "bool", "to_numpy_dtype", "from_any", "dtype_name", "SUPPORTED", "check_supported",
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
# Every dtype a tensor, variable, constant or stream can have (the IPU's types).
SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
             torch.int32, torch.int64, torch.uint32, torch.bool)
# PopXL's ``downcast=True``: 64-bit host data becomes 32-bit on the device.
DOWNCAST = {torch.float64: torch.float32, torch.int64: torch.int32}


def to_numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype that holds host data of ``dtype`` (bfloat16 uses float32)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.float32)
    return np.dtype(_TO_NUMPY[dtype])


def from_any(dtype: object, subject: str | None = None, *, host_data: builtins.bool = True) -> torch.dtype:
    """Turn a torch dtype, numpy dtype or PopXL-style name into a torch dtype.

    Args:
        dtype: a ``torch.dtype`` (returned as it is), a numpy dtype (or anything
            ``np.dtype`` accepts) of a supported type, or a torch dtype name.
        subject: what the dtype is for (``"variable 'w'"``), named in the error.
        host_data: the dtype is that of host data (the fix says how to convert it),
            not one asked for (a stream's: the fix says which to ask for).

    Raises:
        InvalidArgumentError: (a TypeError) ``dtype`` names no dtype, or a numpy
            dtype without an ipuxl equivalent (complex, strings, objects, uint64...).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype, None)
        if isinstance(found, torch.dtype):
            return found
        _raise(f"unknown dtype name {dtype!r}", subject, "use a supported dtype, e.g. ipuxl.float32")
    try:
        np_dtype = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        _raise(f"cannot interpret {dtype!r} as a dtype", subject, "use a supported dtype, e.g. ipuxl.float32")
    if np_dtype not in _FROM_NUMPY:
        _raise(f"dtype {np_dtype} is not supported", subject, _fix_for(np_dtype, host_data))
    return _FROM_NUMPY[np_dtype]


def check_supported(dtype: torch.dtype, subject: str | None = None, *, host_data: builtins.bool = True) -> torch.dtype:
    """``dtype`` itself when ipuxl can hold it on the device and stream it; raises otherwise.

    Raises:
        InvalidArgumentError: (a TypeError) a torch dtype outside ``SUPPORTED``
            (complex, float8, uint16, uint64...).
    """
    if dtype not in SUPPORTED:
        _raise(f"dtype {dtype_name(dtype)} is not supported", subject, _fix_for(dtype, host_data))
    return dtype


def _fix_for(dtype: np.dtype | torch.dtype, host_data: builtins.bool) -> str:
    complex_ = dtype.is_complex if isinstance(dtype, torch.dtype) else dtype.kind == "c"
    if complex_ and host_data:
        return ("IPUs have no complex type: convert the data with data.astype(np.float32) (keeps the real "
                "part), or hold the real and imaginary parts as two float32 tensors (data.real, data.imag)")
    if complex_:
        return ("IPUs have no complex type: use ipuxl.float32, with one stream for the real part and one "
                "for the imaginary part if both are needed")
    if host_data:
        return "convert the data to a supported dtype first, e.g. data.astype(np.float32) or data.astype(np.int32)"
    return "use a supported dtype, e.g. ipuxl.float32 or ipuxl.int32"


def _raise(problem: str, subject: str | None, fix: str) -> NoReturn:
    from ipuxl.errors import InvalidArgumentError
    from ipuxl.ir.context import user_source_line  # the IR imports this module: bind late

    line = user_source_line()
    where = ", ".join(p for p in (line, subject) if p) or None
    head = f"{subject}: " if subject else ""
    raise InvalidArgumentError(f"{head}{problem}; ipuxl supports {', '.join(map(dtype_name, SUPPORTED))}",
                               where=where, fix=fix) from None


def dtype_name(dtype: torch.dtype) -> str:
    """PopXL's short name of a dtype (``float32``, not ``torch.float32``)."""
    return str(dtype).replace("torch.", "")
