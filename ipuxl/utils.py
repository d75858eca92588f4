"""PopXL's ``popxl.utils``: host-data helpers (``to_numpy``, ``downcast_np_dtypes``) and the host
float8 casts (``host_pow2scale_then_cast``... from ``ipuxl.fp8_utils``)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ipuxl import dtypes
from ipuxl.dtypes import np_dtype_float8_143, np_dtype_float8_152
from ipuxl.fp8_utils import (
    host_cast_then_pow2scale, host_pow2scale_cast_from_fp8, host_pow2scale_cast_to_fp8, host_pow2scale_then_cast,
    to_host,
)

__all__ = ["to_numpy", "downcast_np_dtypes", "host_pow2scale_then_cast", "host_cast_then_pow2scale",
           "host_pow2scale_cast_to_fp8", "host_pow2scale_cast_from_fp8", "np_dtype_float8_143", "np_dtype_float8_152"]

#: What ``downcast=True`` turns 64-bit host data into (PopXL's table).
downcast_np_dtypes = {
    np.dtype("int64"): np.dtype("int32"),
    np.dtype("uint64"): np.dtype("uint32"),
    np.dtype("float64"): np.dtype("float32"),
}


def to_numpy(x: Any, dtype: Any = None, downcast: bool = True, copy: bool = True,
             log2_scale: int | None = None, nan_on_overflow: bool | None = None) -> np.ndarray:
    """Host data as a C-ordered numpy array, as PopXL's ``popxl.utils.to_numpy``.

    Args:
        x: a numpy array, torch tensor (bfloat16 reads as float32), or anything
            ``np.asarray`` takes.
        dtype: the dtype to convert to (PopXL, torch or numpy dtype, or a name);
            default: ``x``'s own.
        downcast: without ``dtype``, 64-bit data becomes 32-bit (``downcast_np_dtypes``).
        copy: always return a new array (otherwise ``x`` itself when it already fits).
        log2_scale, nan_on_overflow: for a float8 ``dtype`` (``float8_143``, ``float8_152``),
            float data become float8 host data as ``host_pow2scale_cast_to_fp8(x, dtype,
            log2_scale, nan_on_overflow)`` (defaults 0 and True); float8 host data of
            ``dtype`` are kept. PopXL cannot infer a float8 dtype from float data: give it.

    Raises:
        UnsupportedError: (a RuntimeError) ``log2_scale`` or ``nan_on_overflow`` is set for a
            dtype that is not float8, or float8 data from an unsupported dtype.
        DtypeError: (a ValueError) ``dtype`` names no dtype.
    """
    target_dtype = dtypes.dtype.as_dtype(dtype) if dtype is not None else None
    log2_scale, nan_on_overflow = dtypes.float8_options("to_numpy", target_dtype, log2_scale, nan_on_overflow)
    if isinstance(x, torch.Tensor):
        x = to_host(x.detach().cpu())
    if target_dtype is not None and dtypes.is_float8(target_dtype):
        array = np.asarray(x, order="C")
        if array.dtype != target_dtype.as_numpy():
            return host_pow2scale_cast_to_fp8(array, target_dtype, log2_scale, nan_on_overflow)
        return array.copy() if copy and (array is x or np.shares_memory(array, np.asarray(x))) else array
    if dtype is not None:
        target = dtypes.to_numpy_dtype(dtypes.dtype.as_dtype(dtype))
        array = np.asarray(x, dtype=target, order="C")
    else:
        array = np.asarray(x, order="C")
        if downcast and array.dtype in downcast_np_dtypes:
            return np.array(array, dtype=downcast_np_dtypes[array.dtype], order="C")
    if copy and (array is x or np.shares_memory(array, np.asarray(x))):
        array = array.copy()
    return array
