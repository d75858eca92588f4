"""PopXL's ``popxl.fp8_utils``: float8 host data, converted from and to floats on the host.

numpy has no float8 type, so float8 host data are numpy arrays of the structured dtypes
``ipuxl.dtypes.np_dtype_float8_143``/``np_dtype_float8_152`` (one ``u1`` field holding the
bits), as in PopXL. The conversions are those of the device's casts (``ipuxl.kernels.float8``:
torch's fnuz float8 types, which are PopXL's formats bit for bit), so a host cast and a
device cast of the same data agree exactly.

``to_tensor``/``to_host`` (ipuxl's) move such arrays to torch float8 tensors and back.
``host_fp8_mse_scale`` picks a scale for a cast to float8 on the host, by PopXL's
histogram-based mean-squared-error estimate.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ipuxl import dtypes
from ipuxl.dtypes import float8_143, float8_152, float16, float32, float64, np_dtype_float8_143, np_dtype_float8_152
from ipuxl.errors import InvalidValueError, UnsupportedError
from ipuxl.kernels import float8 as kernels
from ipuxl.source import user_source_line

__all__ = ["host_pow2scale_cast_to_fp8", "host_pow2scale_cast_from_fp8", "host_pow2scale_then_cast",
           "host_cast_then_pow2scale", "host_fp8_mse_scale", "to_tensor", "to_host", "is_float8_array",
           "np_dtype_float8_143", "np_dtype_float8_152"]

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


# -- host_fp8_mse_scale ------------------------------------------------------------------------------
#: the scales the search tries, as PopXL's (``b`` is a 6-bit signed value)
_MIN_SCALING_BIAS, _MAX_SCALING_BIAS = -31, 31
#: (exponent bits, mantissa bits, fixed exponent bias, denormals count, NaN codes): PopXL's ``FpDef``s
_FP32_NO_DENORMS = (8, 23, 127, False, True)
_FLOAT8_DEFS = {float8_143: (4, 3, 8, True, False), float8_152: (5, 2, 16, True, False)}
#: mantissa bits of the source, for the quantisation error
_SOURCE_MANTISSA_BITS = {np.dtype(np.float32): 23, np.dtype(np.float16): 10}


def _exponent_range(num_exp_bits: int, num_mantissa_bits: int, bias: int, include_denorm: bool,
                    has_nans: bool) -> tuple[int, int]:
    """The smallest and largest exponent of a format (PopXL's ``find_exponential_range``)."""
    low = 1 - bias - (num_mantissa_bits if include_denorm else 0)
    return low, (1 << num_exp_bits) - 1 - int(has_nans) - bias


def _log2_histogram(values: np.ndarray, low: int, high: int) -> tuple[list[float], list[float]]:
    """(normalised counts, limits): the limits are ``2**low .. 2**(high-1)``; count 0 is below
    the first, the last above the last limit, count ``i`` the binade ``[limits[i-1], 2 * limits[i-1])``."""
    limits = [2.0 ** e for e in range(low, high)]
    magnitudes = np.abs(values.astype(np.float64))
    below, above = magnitudes < limits[0], magnitudes > limits[-1]
    inside = ~(below | above)  # NaN too, in the binade frexp gives it (exponent 0), as PopXL
    counts = np.bincount(np.frexp(magnitudes[inside])[1] - low, minlength=len(limits) + 1).astype(np.float64)
    counts[0] += np.count_nonzero(below)
    counts[-1] += np.count_nonzero(above)
    return (counts / values.size).tolist(), limits


def _least_mse(hist: list[float], limits: list[float], first: int, last: int, span: int,
               quantisation_error: float) -> tuple[float, int]:
    """PopXL's ``calculate_metric_mse``: the least cost and the scaling bias of the middle of the
    candidates that share it, in float64 summed in PopXL's order (so ties are PopXL's)."""
    by_mse: dict[float, list[int]] = {}
    for index, start in enumerate(range(first, last + 1)):
        mse = 0.0
        for i in range(start):
            if i == 0:
                mse += (limits[0] / 2) ** 2  # PopXL's constant underflow term
            mse += limits[i] ** 2 * hist[i + 1]
        for i in range(start, min(start + span, len(limits))):
            mse += limits[i] ** 2 * hist[i + 1] * quantisation_error
        for i in range(start + span, len(limits)):
            # sic: PopXL measures the overflow from limits[index + span - 1], not limits[start + span - 1]
            mse += (limits[index + span - 1] - limits[i]) ** 2 * hist[i + 1]
        by_mse.setdefault(mse, []).append(index + _MIN_SCALING_BIAS)
    lowest = min(by_mse)
    tied = sorted(by_mse[lowest])
    return lowest, tied[len(tied) // 2]


def host_fp8_mse_scale(src: Any, dtype: Any = None) -> tuple[float, int]:
    """PopXL's ``popxl.fp8_utils.host_fp8_mse_scale``: ``(mse, s)``, the log2 scale ``s`` for
    which ``cast(src * 2**s, dtype)`` loses the least by a histogram estimate of the mean
    squared error, and that estimate.

    ``|src|`` is binned by float32 binade (``2**-126 .. 2**126``); for each scaling bias
    ``b`` in [-31, 31] the binades below the format's range (at that bias) cost their
    squared value, those in range the squared value times ``2**(-2 * (source - float8
    mantissa bits))``, those above it their squared distance from the top of the range
    (as PopXL: from ``limits[b + 31 + span - 1]``). ``s = -b`` for the middle of the biases
    of least cost. ``dtype`` ``None`` is ``float8_143`` (PopXL's default).
    ``popxl_addons.ops.fp8_mse_scale`` is the device op (float32, 62 candidates).

    Raises:
        UnsupportedError: (a RuntimeError, as PopXL's) ``src`` is not float16/float32 data, or
            ``dtype`` is neither ``None`` nor float8.
        InvalidValueError: (a ValueError) ``src`` is empty.
    """
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    array = np.asarray(src)
    if array.dtype not in _SOURCE_MANTISSA_BITS:
        raise _runtime_error(f"dtype {array.dtype} not currently supported.")
    if array.size == 0:
        raise InvalidValueError("host_fp8_mse_scale: src has no elements", where=user_source_line(),
                                fix="pass the data the scale is for")
    dest = _FLOAT8_DEFS[float8_143 if dtype is None else _float8_target(dtype)]
    hist_low, hist_high = _exponent_range(*_FP32_NO_DENORMS)
    hist, limits = _log2_histogram(array.reshape(-1), hist_low, hist_high)
    dest_low, dest_high = _exponent_range(*dest)
    quantisation_error = 2 ** (-2.0 * (_SOURCE_MANTISSA_BITS[array.dtype] - dest[1]))
    first = max(dest_low + _MIN_SCALING_BIAS - hist_low, 0)
    last = min(dest_low + _MAX_SCALING_BIAS - hist_low, hist_high - hist_low)
    lowest, bias = _least_mse(hist, limits, first, last, dest_high - dest_low + 1, quantisation_error)
    return lowest, -bias
