"""PopXL's ``popxl.fp8_utils``: float8 host data, converted from and to floats on the host.

numpy has no float8 type, so float8 host data are numpy arrays of the structured dtypes
``ipuxl.dtypes.np_dtype_float8_143``/``np_dtype_float8_152`` (one ``u1`` field holding the
bits), as in PopXL. The conversions are those of the device's casts (``ipuxl.kernels.float8``:
torch's fnuz float8 types, which are PopXL's formats bit for bit), so a host cast and a
device cast of the same data agree exactly.

``to_tensor``/``to_host`` (ipuxl's) move such arrays to torch float8 tensors and back.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ipuxl import dtypes
from ipuxl.dtypes import float8_143, float8_152, float16, float32, float64, np_dtype_float8_143, np_dtype_float8_152
from ipuxl.errors import UnsupportedError
from ipuxl.kernels import float8 as kernels
from ipuxl.source import user_source_line

__all__ = ["host_pow2scale_cast_to_fp8", "host_pow2scale_cast_from_fp8", "host_pow2scale_then_cast",
           "host_cast_then_pow2scale", "to_tensor", "to_host", "is_float8_array", "np_dtype_float8_143",
           "np_dtype_float8_152"]

_NUMPY_OF = {float8_143: np_dtype_float8_143, float8_152: np_dtype_float8_152}
_FLOAT8_OF = {np_dtype_float8_143: float8_143, np_dtype_float8_152: float8_152}


def is_float8_array(array: Any) -> bool:
    """Whether ``array`` is float8 host data (a numpy array of a float8 structured dtype)."""
    return isinstance(array, np.ndarray) and array.dtype in _FLOAT8_OF


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """float8 host data as a torch float8 tensor sharing their memory (other arrays: ``torch.from_numpy``)."""
    if not is_float8_array(array):
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(np.uint8)).view(_FLOAT8_OF[array.dtype].as_torch())


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's data as a numpy array: float8 as PopXL's structured arrays (sharing the
    memory), bfloat16 as float32 (numpy has neither)."""
    if tensor.dtype in dtypes.FLOAT8:
        return tensor.view(torch.uint8).numpy().view(dtypes.to_numpy_dtype(tensor.dtype))
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _runtime_error(problem: str) -> Exception:
    return UnsupportedError(problem, where=user_source_line())


def _float_source(src: Any, allowed: tuple[type, ...]) -> np.ndarray:
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    array = np.asarray(src, order="C")
    if array.dtype.type not in allowed:
        raise _runtime_error(f"src.dtype {array.dtype} not currently supported.")
    return array


def _float8_target(dtype: Any) -> dtypes.dtype:
    if dtype not in (float8_143, float8_152):
        raise _runtime_error(f"dtype {dtype} not currently supported.")
    return float8_143 if dtype == float8_143 else float8_152


def _cast_to(array: np.ndarray, target: dtypes.dtype, log2_scale: int, nan_on_overflow: bool) -> np.ndarray:
    converted = kernels.pow2scale_then_cast(torch.from_numpy(np.ascontiguousarray(array)), int(log2_scale),
                                            target.as_torch(), bool(nan_on_overflow))
    return to_host(converted).reshape(array.shape).copy()


def host_pow2scale_cast_to_fp8(src: Any, dtype: Any = None, log2_scale: int = 0,
                               nan_on_overflow: bool = True) -> np.ndarray:
    """``cast(src * 2**log2_scale, dtype)`` on the host: float16, float32 or float64 data (numpy
    or torch) to float8 host data of ``dtype`` (``float8_143`` or ``float8_152``).

    Values beyond the format's range become NaN with ``nan_on_overflow``, else the largest
    value of their sign. ``log2_scale`` should be in [-32, 32).

    Raises:
        UnsupportedError: (a RuntimeError, as PopXL's) another source dtype, or ``dtype`` is not float8.
    """
    array = _float_source(src, (np.float16, np.float32, np.float64))
    return _cast_to(array, _float8_target(dtype), log2_scale, nan_on_overflow)


def host_pow2scale_then_cast(src: Any, dtype: Any = None, log2_scale: int = 0,
                             nan_on_overflow: bool = True) -> np.ndarray:
    """PopXL's ``popxl.utils.host_pow2scale_then_cast``: ``host_pow2scale_cast_to_fp8`` for
    float32 or float64 data.

    Raises:
        UnsupportedError: (a RuntimeError) another source dtype, or ``dtype`` is not float8.
    """
    array = _float_source(src, (np.float32, np.float64))
    return _cast_to(array, _float8_target(dtype), log2_scale, nan_on_overflow)


def _from(src: Any, dtype: Any, log2_scale: int, allowed: tuple[dtypes.dtype, ...]) -> np.ndarray:
    if not is_float8_array(src):
        raise _runtime_error(f"src.dtype {getattr(src, 'dtype', type(src).__name__)} not currently supported.")
    if dtype not in allowed:
        raise _runtime_error(f"dtype {dtype} not currently supported.")
    target = next(d for d in allowed if d == dtype)
    values = kernels.cast_then_pow2scale(to_tensor(np.ascontiguousarray(src)), int(log2_scale), target.as_torch())
    return values.numpy().reshape(src.shape).copy()


def host_pow2scale_cast_from_fp8(src: np.ndarray, dtype: Any = None, log2_scale: int = 0) -> np.ndarray:
    """``cast(src, dtype) * 2**log2_scale`` on the host: float8 host data to a float16, float32
    or float64 array (NaN for the NaN code).

    Raises:
        UnsupportedError: (a RuntimeError) ``src`` is not float8 host data, or another ``dtype``.
    """
    return _from(src, dtype, log2_scale, (float16, float32, float64))


def host_cast_then_pow2scale(src: np.ndarray, dtype: Any = None, log2_scale: int = 0) -> np.ndarray:
    """PopXL's ``popxl.utils.host_cast_then_pow2scale``: ``host_pow2scale_cast_from_fp8`` to float32 or float64.

    Raises:
        UnsupportedError: (a RuntimeError) ``src`` is not float8 host data, or another ``dtype``.
    """
    return _from(src, dtype, log2_scale, (float32, float64))
