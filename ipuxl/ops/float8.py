"""PopXL's float8 ops: power-of-two scaled casts to and from float8, and the scaled float8
matmul and convolutions (``ops.matmul_pow2scaled``, ``ops.conv_pow2scaled``,
``ops.conv_transpose_pow2scaled``), whose results are float16.

The casts run ``ipuxl.kernels.float8`` (torch's fnuz float8 types, PopXL's formats bit for
bit), as the host helpers of ``ipuxl.fp8_utils`` do, so device and host casts agree
exactly. The scaled matmul and convolutions cast their float8 operands to float32
(exactly), compute there with ``ops.matmul``/``ops.conv``/``ops.conv_transpose`` (so they
take the same padding and shape rules), then scale by ``2**log2_scale`` and round once to
float16. ``log2_scale`` is a scalar int32 tensor; the device takes a 6-bit signed scale: a
value outside [-32, 32) stops the run with ``ApplicationRuntimeError``
(``popart.poplar_application_runtime_error``) under PopART's session option
``throwIfLog2ScaleTensorNotInRange`` (on by default, as upstream), and is clipped into the
range with the option off (``device.fp_checks.strict_float8_scales``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ipuxl.dtypes import FLOAT8, DTypeLike, dtype_name, float8_143, float16, from_any
from ipuxl.errors import InvalidArgumentError, InvalidValueError
from ipuxl.ir.build import emit
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import float8 as kernels
from ipuxl.ops.conv import PadType, conv, conv_transpose
from ipuxl.ops.nn import matmul
from ipuxl.ops.shape import cast

__all__ = ["pow2scale_cast_to_fp8", "pow2scale_cast_from_fp8", "matmul_pow2scaled", "conv_pow2scaled",
           "conv_transpose_pow2scaled"]


def _check_log2_scale(op_name: str, log2_scale: Tensor) -> None:
    if not isinstance(log2_scale, Tensor) or log2_scale.rank > 0:
        shape = getattr(log2_scale, "shape", type(log2_scale).__name__)
        raise InvalidValueError(f"{op_name}: Log2 scale argument must be a scalar tensor, got {shape}",
                                where=user_source_line(), fix="pass a scalar int32 tensor, e.g. "
                                "popxl.constant(0, popxl.int32)")
    if log2_scale.spec.dtype != torch.int32:
        raise InvalidArgumentError(f"{op_name}: Log2 scale tensor must be of type popxl.int32, got "
                                   f"{dtype_name(log2_scale.spec.dtype)}", where=user_source_line(),
                                   fix="cast it with ops.cast(log2_scale, popxl.int32)")


def _check_float8_operands(op_name: str, what: str, *operands: Tensor) -> None:
    for t in operands:
        if t.spec.dtype not in FLOAT8:
            raise InvalidArgumentError(
                f"{op_name}: Scaled {what} operands must be of dtype popxl.float8_143 or popxl.float8_152, "
                f"'{t.name}' is {dtype_name(t.spec.dtype)}", where=user_source_line(),
                fix="cast them first with ops.pow2scale_cast_to_fp8")


def pow2scale_cast_to_fp8(t: Tensor, log2_scale: Tensor, data_type: DTypeLike = float8_143,
                          nan_on_overflow: bool = True) -> Tensor:
    """``cast(t * 2**log2_scale, data_type)``: float16 or float32 ``t`` to a float8 dtype.

    Rounds to nearest, ties to even; values beyond the format's range become NaN (ipuxl's
    ``nan_on_overflow=False`` saturates them instead).

    Raises:
        InvalidArgumentError: (a TypeError) ``t`` is not float16/float32, ``data_type`` is
            not float8, or ``log2_scale`` is not int32.
        InvalidValueError: (a ValueError) ``log2_scale`` is not a scalar.
    """
    target = from_any(data_type)
    if target not in FLOAT8:
        raise InvalidArgumentError(f"pow2scale_cast_to_fp8: data_type must be popxl.float8_143 or popxl.float8_152, "
                                   f"got {dtype_name(target)}", where=user_source_line(),
                                   fix="use ops.cast for other dtypes")
    if t.spec.dtype not in (torch.float16, torch.float32):
        raise InvalidArgumentError(f"pow2scale_cast_to_fp8: input '{t.name}' must be float16 or float32, got "
                                   f"{dtype_name(t.spec.dtype)}", where=user_source_line(),
                                   fix="cast it to popxl.float16 first")
    _check_log2_scale("pow2scale_cast_to_fp8", log2_scale)
    return emit("pow2scale_cast_to_fp8", kernels.pow2scale_then_cast, (t, log2_scale, target, bool(nan_on_overflow)))


def pow2scale_cast_from_fp8(t: Tensor, log2_scale: Tensor, data_type: DTypeLike = float16) -> Tensor:
    """``cast(t, data_type) * 2**log2_scale``: a float8 ``t`` to float16 or float32 (exact before
    the one rounding to ``data_type``; NaN for the NaN code).

    Raises:
        InvalidArgumentError: (a TypeError) ``t`` is not float8, ``data_type`` is not
            float16/float32, or ``log2_scale`` is not int32.
        InvalidValueError: (a ValueError) ``log2_scale`` is not a scalar.
    """
    target = from_any(data_type)
    if target not in (torch.float16, torch.float32):
        raise InvalidArgumentError(f"pow2scale_cast_from_fp8: data_type must be popxl.float16 or popxl.float32, "
                                   f"got {dtype_name(target)}", where=user_source_line(),
                                   fix="cast the result with ops.cast")
    if t.spec.dtype not in FLOAT8:
        raise InvalidArgumentError(f"pow2scale_cast_from_fp8: input '{t.name}' must be popxl.float8_143 or "
                                   f"popxl.float8_152, got {dtype_name(t.spec.dtype)}", where=user_source_line(),
                                   fix="use ops.cast for other dtypes")
    _check_log2_scale("pow2scale_cast_from_fp8", log2_scale)
    return emit("pow2scale_cast_from_fp8", kernels.cast_then_pow2scale, (t, log2_scale, target))


def _scaled(op_name: str, out: Tensor, log2_scale: Tensor) -> Tensor:
    return emit(op_name, kernels.cast_then_pow2scale, (out, log2_scale, torch.float16))


def matmul_pow2scaled(lhs: Tensor, rhs: Tensor, log2_scale: Tensor,
                      available_memory_proportion: float | None = None) -> Tensor:
    """``matmul(lhs, rhs) * 2**log2_scale`` of two float8 tensors, as float16 (numpy matmul rules).

    Raises:
        InvalidArgumentError: (a TypeError) an operand is not float8, or ``log2_scale`` is not int32.
        InvalidValueError: (a ValueError) ``log2_scale`` is not a scalar.
    """
    _check_float8_operands("matmul_pow2scaled", "matmul", lhs, rhs)
    _check_log2_scale("matmul_pow2scaled", log2_scale)
    out = matmul(cast(lhs, torch.float32), cast(rhs, torch.float32), available_memory_proportion)
    return _scaled("matmul_pow2scaled", out, log2_scale)


def conv_pow2scaled(t: Tensor, weight: Tensor, log2_scale: Tensor, stride: Sequence[int] | None = (1, 1),
                    padding: Sequence[int] | None = (0, 0, 0, 0), dilation: Sequence[int] | None = (1, 1),
                    groups: int | None = 1, pad_type: PadType | None = "not_set",
                    available_memory_proportions: list[float] | None = None,
                    enable_conv_dithering: list[int] | None = None) -> Tensor:
    """``ops.conv`` of float8 ``t`` and ``weight``, scaled by ``2**log2_scale``, as float16.

    Raises:
        InvalidArgumentError: (a TypeError) an operand is not float8, or ``log2_scale`` is not int32.
        InvalidValueError: (a ValueError) ``log2_scale`` is not a scalar.
    """
    _check_float8_operands("conv_pow2scaled", "conv", t, weight)
    _check_log2_scale("conv_pow2scaled", log2_scale)
    out = conv(cast(t, torch.float32), cast(weight, torch.float32), stride, padding, dilation, groups, pad_type,
               available_memory_proportions, None, enable_conv_dithering)
    return _scaled("conv_pow2scaled", out, log2_scale)


def conv_transpose_pow2scaled(t: Tensor, weight: Tensor, log2_scale: Tensor, stride: Sequence[int] | None = (1, 1),
                              padding: Sequence[int] | None = (0, 0, 0, 0),
                              dilation: Sequence[int] | None = (1, 1), groups: int | None = 1,
                              pad_type: PadType | None = "not_set", output_padding: Sequence[int] | None = (),
                              output_shape: Sequence[int] | None = (),
                              available_memory_proportions: list[float] | None = None,
                              enable_conv_dithering: list[int] | None = None) -> Tensor:
    """``ops.conv_transpose`` of float8 ``t`` and ``weight``, scaled by ``2**log2_scale``, as float16.

    Raises:
        InvalidArgumentError: (a TypeError) an operand is not float8, or ``log2_scale`` is not int32.
        InvalidValueError: (a ValueError) ``log2_scale`` is not a scalar.
    """
    _check_float8_operands("conv_transpose_pow2scaled", "conv", t, weight)
    _check_log2_scale("conv_transpose_pow2scaled", log2_scale)
    out = conv_transpose(cast(t, torch.float32), cast(weight, torch.float32), stride, padding, dilation, groups,
                         pad_type, output_padding or None, output_shape or None, available_memory_proportions, None,
                         enable_conv_dithering)
    return _scaled("conv_transpose_pow2scaled", out, log2_scale)
