"""popxl.addons' ``fp8_amax_scale``: the power-of-two scale that fits a tensor's largest
magnitude into a float8 format.

``floor(log2(max_value / max(|src|)))`` clipped to [-31, 31], an int32 scalar: scaling
``src`` by ``2**scale`` before ``ops.pow2scale_cast_to_fp8`` keeps its largest value within
the format's range (240 for ``float8_143``, 57344 for ``float8_152``). As upstream, the
quotient, the logarithm and the floor are computed in ``src``'s dtype.
"""
from __future__ import annotations

import torch

from ipuxl import ops
from ipuxl.addons_compat.ops.fp8_utils import FpDef, float8_143_def, float8_152_def
from ipuxl.dtypes import DTypeLike, dtype_name, float8_143, float8_152, float16, float32
from ipuxl.errors import UnsupportedError
from ipuxl.ir import context
from ipuxl.ir.tensor import Tensor

__all__ = ["fp8_amax_scale", "float8_format", "SCALE_RANGE"]

#: the scales a float8 cast takes here, as upstream (the device's 6-bit range is [-32, 32))
SCALE_RANGE = (-31, 31)


def float8_format(op_name: str, src: Tensor, dtype: DTypeLike) -> FpDef:
    """The ``FpDef`` of the float8 ``dtype`` a float16/float32 ``src`` is scaled for.

    Raises:
        UnsupportedError: (a RuntimeError, as upstream) ``src`` is not float16/float32, or
            ``dtype`` is not ``float8_143``/``float8_152``.
    """
    if src.dtype not in (float16, float32):
        raise UnsupportedError(f"{op_name}: dtype {dtype_name(src.dtype)} not currently supported.",
                               where=context.user_source_line(), fix="cast the tensor to float16 or float32 first")
    if dtype == float8_143:
        return float8_143_def
    if dtype == float8_152:
        return float8_152_def
    raise UnsupportedError(f"{op_name}: the target dtype must be float8_143 or float8_152, got {dtype!r}",
                           where=context.user_source_line(), fix="pass popxl.float8_143 or popxl.float8_152")


def fp8_amax_scale(src: Tensor, dtype: DTypeLike = float8_143) -> Tensor:
    """The log2 scale (an int32 scalar) that takes ``src``'s largest magnitude to at most the
    largest value of the float8 ``dtype``: ``floor(log2(max_value / max(|src|)))`` in [-31, 31].

    A zero ``src`` (an infinite quotient) gives 31, as the device's saturating cast to int32.

    Raises:
        UnsupportedError: (a RuntimeError) ``src`` is not float16/float32, or ``dtype`` is not float8.
    """
    dest = float8_format("fp8_amax_scale", src, dtype)
    amax = ops.max(ops.abs(src))
    log2_max = ops.floor(ops.log2(dest.max_value / amax))
    return ops.cast(ops.clip(log2_max, *SCALE_RANGE), torch.int32)  # clipped first: int32 cannot hold infinity
