"""PopXL's ``popxl.testing``: the dtypes a test can loop over.

``get_all_dtypes()`` lists PopXL's integer, floating point and complex dtypes (not
``bool``, nor ipuxl's ``bfloat16``); ``get_all_int_dtypes`` the integer ones, signed
and/or unsigned. Not every listed dtype can be a tensor's (``dtypes.SUPPORTED``).
"""
from __future__ import annotations

from ipuxl import dtypes

__all__ = ["get_all_dtypes", "get_all_int_dtypes"]

_SIGNED = [dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64]
_UNSIGNED = [dtypes.uint8, dtypes.uint16, dtypes.uint32, dtypes.uint64]
_FLOATING = [dtypes.float16, dtypes.float32, dtypes.float64]
_COMPLEX = [dtypes.complex64, dtypes.complex128]


def get_all_dtypes() -> list[dtypes.dtype]:
    """Every integer, floating point and complex dtype, in PopXL's order."""
    return get_all_int_dtypes() + _FLOATING + _COMPLEX


def get_all_int_dtypes(include_signed: bool = True, include_unsigned: bool = True) -> list[dtypes.dtype]:
    """The signed (``int8``...) and/or unsigned (``uint8``...) integer dtypes."""
    return (_SIGNED if include_signed else []) + (_UNSIGNED if include_unsigned else [])
