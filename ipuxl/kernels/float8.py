"""float8 kernels: PopXL's power-of-two scaled casts to and from float8, and its scaled
float8 matmul and convolutions.

The float8 types are torch's ``float8_e4m3fnuz`` (PopXL's ``float8_143``) and
``float8_e5m2fnuz`` (``float8_152``): the same formats bit for bit (see ``ipuxl.dtypes``).
A cast to float8 rounds to nearest, ties to even, as torch's casts do; a value beyond the
format's range (infinities included) becomes NaN (0x80) with ``nan_on_overflow``, else
the largest value of its sign. Scaling by ``2**log2_scale`` is exact: float16 and float32
data are scaled in float32, whose range holds any float16 or float8 value times
``2**±32``; float64 data are scaled in float64 and reach float32 by rounding to odd, so
that the one rounding to float8 is still correct. The scaled matmul and convolutions
(``ipuxl.ops.float8``) multiply the float8 operands' exact values in float32, then scale
and round once to float16 (PopXL's accumulate in float16 partials: results can differ in
the last float16 bits).

The host helpers of ``ipuxl.fp8_utils`` and the device ops of ``ipuxl.ops.float8`` both
call these functions, so the host and the device convert alike.
"""
from __future__ import annotations

import torch

from ipuxl.kernels.program_stop import ProgramStop

__all__ = ["FLOAT8_MAX", "LOG2_SCALE_RANGE", "Log2ScaleRangeError", "pow2scale_then_cast", "cast_then_pow2scale"]

#: The largest finite value of each float8 format.
FLOAT8_MAX = {torch.float8_e4m3fnuz: 240.0, torch.float8_e5m2fnuz: 57344.0}
#: The scales the device takes: a 6-bit signed integer, [-32, 32).
LOG2_SCALE_RANGE = (-32, 31)


class Log2ScaleRangeError(ProgramStop, ValueError):
    """A float8 scale outside the device's 6-bit range, under ``throwIfLog2ScaleTensorNotInRange``."""


def _scale_of(log2_scale: int | torch.Tensor, device: torch.device, strict: bool) -> torch.Tensor:
    """``log2_scale`` as a float32 scalar tensor, clipped into the device's range; ``strict``
    (PopART's ``throwIfLog2ScaleTensorNotInRange``): out of range raises instead."""
    scale = torch.as_tensor(log2_scale, device=device)
    low, high = LOG2_SCALE_RANGE
    if strict and not low <= int(scale) <= high:
        raise Log2ScaleRangeError(
            f"the log2 scale tensor holds {int(scale)}, outside the range a float8 scale takes on the device "
            f"([{low}, {high + 1}): a 6-bit signed integer)")
    return scale.clamp(low, high).to(torch.float32)


def _to_float32_odd(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x`` in float32, rounded to odd (truncate, then set the last bit when inexact): a
    later rounding to a format of fewer than 22 significand bits is then as if done from ``x``."""
    y = x.to(torch.float32)
    back = y.to(torch.float64)
    too_far = back.abs() > x.abs()
    y = torch.where(too_far & torch.isfinite(y), torch.nextafter(y, torch.zeros_like(y)), y)
    inexact = (y.to(torch.float64) != x) & torch.isfinite(y)
    bits = y.view(torch.int32)
    return torch.where(inexact, bits | 1, bits).view(torch.float32)


def pow2scale_then_cast(x: torch.Tensor, log2_scale: int | torch.Tensor, dtype: torch.dtype,
                        nan_on_overflow: bool = True, *, strict: bool = False) -> torch.Tensor:
    """``cast(x * 2**log2_scale, dtype)`` for float16/32/64 ``x`` and a float8 ``dtype`` (``strict``:
    a scale out of the device's range raises ``Log2ScaleRangeError`` instead of being clipped)."""
    scale = _scale_of(log2_scale, x.device, strict)
    if x.dtype == torch.float64:
        scaled = _to_float32_odd(x * torch.exp2(scale.to(torch.float64)))
    else:
        scaled = x.to(torch.float32) * torch.exp2(scale)
    if not nan_on_overflow:
        bound = FLOAT8_MAX[dtype]
        scaled = scaled.clamp(-bound, bound)  # NaN stays NaN; infinities saturate too
    return scaled.to(dtype)


def cast_then_pow2scale(x: torch.Tensor, log2_scale: int | torch.Tensor, dtype: torch.dtype, *,
                        strict: bool = False) -> torch.Tensor:
    """``cast(x, dtype) * 2**log2_scale`` for float8 ``x`` (exact in float32, then one rounding to
    ``dtype``); also the scaling of the float32 result of a scaled matmul or convolution
    (``strict`` as ``pow2scale_then_cast``)."""
    scale = _scale_of(log2_scale, x.device, strict)
    if dtype == torch.float64:
        return x.to(torch.float64) * torch.exp2(scale.to(torch.float64))
    return (x.to(torch.float32) * torch.exp2(scale)).to(dtype)
