"""Convolutions and pooling (PopXL's ``conv``, ``conv_transpose``, ``max_pool``, ``average_pool``).

Inputs are ``(N, C, *spatial)`` with 1, 2 or 3 spatial axes, as in ONNX. Padding is
PopXL's ``(begin_0, begin_1, ..., end_0, end_1, ...)``; asymmetric padding pads the
input explicitly. ``pad_type`` / ``auto_pad`` is ONNX's ``auto_pad``: ``same_upper``
and ``same_lower`` pad so that ``out = ceil(in / stride)``, ``valid`` pads nothing.
IPU-only tuning arguments (``available_memory_proportions``, ``partials_types``,
``enable_conv_dithering``) are accepted and ignored. The kernels the ops record are in
``ipuxl.kernels.conv`` and ``ipuxl.kernels.pool``.
"""
from __future__ import annotations

import math
from typing import Any, Literal, Sequence

from ipuxl.errors import ShapeMismatchError, UnsupportedError
from ipuxl.ir.build import emit
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import conv as conv_kernels
from ipuxl.kernels import pool as pool_kernels

__all__ = ["conv", "conv_transpose", "max_pool", "average_pool", "PadType"]

PadType = Literal["not_set", "same_upper", "same_lower", "valid"]


def _per_axis(op_name: str, what: str, value: Sequence[int] | None, n: int, default: int,
              length: int | None = None) -> tuple[int, ...]:
    """``value`` as one int per spatial axis (``length`` of them: n, or 2n for pads).

    A value of the 2-D default's length (``(1, 1)``, ``(0, 0, 0, 0)``) made of the
    default is taken as "not given", so the 2-D defaults also serve 1-D and 3-D.
    """
    length = length or n
    if value is None or (len(value) != length and all(v == default for v in value)):
        return (default,) * length
    if len(value) != length:
        raise ShapeMismatchError(f"op '{op_name}': {what} {tuple(value)} needs {length} values for {n} spatial axes",
                                 where=user_source_line(), fix=f"give {length} values")
    return tuple(int(v) for v in value)


def _auto_pads(op_name: str, mode: str, pads: tuple[int, ...], spatial: Sequence[int], kernel: Sequence[int],
               stride: Sequence[int], dilation: Sequence[int]) -> tuple[int, ...]:
    if mode == "not_set":
        return pads
    if mode == "valid":
        return (0,) * len(pads)
    if mode not in ("same_upper", "same_lower"):
        raise _bad_pad_type(op_name, mode)
    totals = [max((math.ceil(i / s) - 1) * s + (k - 1) * d + 1 - i, 0)
              for i, k, s, d in zip(spatial, kernel, stride, dilation)]
    small = [t // 2 for t in totals]
    large = [t - t // 2 for t in totals]
    return tuple(small + large) if mode == "same_upper" else tuple(large + small)


def _bad_pad_type(op_name: str, mode: str) -> Exception:
    return ShapeMismatchError(f"op '{op_name}': pad type {mode!r} is not valid", where=user_source_line(),
                              fix="use 'not_set', 'same_upper', 'same_lower' or 'valid'")


def _spatial_rank(op_name: str, t: Tensor, n: int) -> int:
    if n not in (1, 2, 3) or t.rank != n + 2:
        raise ShapeMismatchError(
            f"op '{op_name}': input '{t.name}' {t.shape} must be (N, C, *spatial) with {n} spatial axes "
            "(1, 2 or 3)", where=user_source_line(), fix="reshape the input or the kernel")
    return n


def conv(t: Tensor, weight: Tensor, stride: Sequence[int] | None = (1, 1),
         padding: Sequence[int] | None = (0, 0, 0, 0), dilation: Sequence[int] | None = (1, 1),
         groups: int | None = 1, pad_type: PadType | None = "not_set",
         available_memory_proportions: list[float] | None = None, partials_types: list[str] | None = None,
         enable_conv_dithering: list[int] | None = None) -> Tensor:
    """Convolution of ``t`` (N, C, *spatial) with ``weight`` (M, C/groups, *kernel), no bias."""
    n = _spatial_rank("conv", t, weight.rank - 2)
    strides = _per_axis("conv", "stride", stride, n, 1)
    dilations = _per_axis("conv", "dilation", dilation, n, 1)
    pads = _per_axis("conv", "padding", padding, n, 0, 2 * n)
    pads = _auto_pads("conv", pad_type or "not_set", pads, t.shape[2:], weight.shape[2:], strides, dilations)
    return emit("conv", conv_kernels.conv, (t, weight, strides, pads, dilations, int(groups or 1)))


def conv_transpose(t: Tensor, weight: Tensor, stride: Sequence[int] | None = (1, 1),
                   padding: Sequence[int] | None = (0, 0, 0, 0), dilation: Sequence[int] | None = (1, 1),
                   groups: int | None = 1, pad_type: PadType | None = "not_set",
                   output_padding: Sequence[int] | None = None, output_shape: Sequence[int] | None = None,
                   available_memory_proportions: list[float] | None = None,
                   partials_types: list[str] | None = None,
                   enable_conv_dithering: list[int] | None = None) -> Tensor:
    """Transposed convolution (ONNX ConvTranspose) of ``t`` (N, C, *spatial) with ``weight``
    (C, M/groups, *kernel): the gradient of ``conv`` with respect to its input.

    Each spatial output size is ``stride * (in - 1) + output_padding + (kernel - 1) *
    dilation + 1 - pad_begin - pad_end``. With ``output_shape`` (spatial sizes), the
    pads are computed to give it (``same_lower`` puts the extra pad at the beginning).
    """
    n = _spatial_rank("conv_transpose", t, weight.rank - 2)
    strides = _per_axis("conv_transpose", "stride", stride, n, 1)
    dilations = _per_axis("conv_transpose", "dilation", dilation, n, 1)
    out_pad = _per_axis("conv_transpose", "output_padding", output_padding, n, 0)
    pads = _per_axis("conv_transpose", "padding", padding, n, 0, 2 * n)
    full = [s * (i - 1) + o + (k - 1) * d + 1 for i, k, s, d, o in
            zip(t.shape[2:], weight.shape[2:], strides, dilations, out_pad)]
    mode = pad_type or "not_set"
    if output_shape:
        wanted = _per_axis("conv_transpose", "output_shape", output_shape, n, -1)
        mode = mode if mode != "not_set" else "same_upper"
        totals = [f - w for f, w in zip(full, wanted)]
    elif mode in ("same_upper", "same_lower"):
        totals = [f - i * s for f, i, s in zip(full, t.shape[2:], strides)]
    else:
        totals = None
    if mode == "valid":
        pads = (0,) * (2 * n)
    elif totals is not None:
        if any(tot < 0 for tot in totals):
            raise ShapeMismatchError(f"op 'conv_transpose': output_shape {tuple(output_shape or ())} is larger than "
                                     f"the full output {tuple(full)}", where=user_source_line(),
                                     fix="use output_padding to grow the output")
        small, large = [tot // 2 for tot in totals], [tot - tot // 2 for tot in totals]
        pads = tuple(small + large) if mode == "same_upper" else tuple(large + small)
    elif mode != "not_set":
        raise _bad_pad_type("conv_transpose", mode)
    return emit("conv_transpose", conv_kernels.conv_transpose, (t, weight, strides, pads, out_pad, dilations, int(groups or 1)))


# -- pooling ----------------------------------------------------------------------------------------------------
def _pool_args(op_name: str, t: Tensor, kernel_size: Sequence[int], stride: Sequence[int] | None,
               padding: Sequence[int] | None, out_pads: Sequence[int] | None, dilation: Sequence[int] | None,
               in_dilations: Sequence[int] | None, auto_pad: str | None) -> tuple[Any, ...]:
    kernel = tuple(int(k) for k in kernel_size)
    n = _spatial_rank(op_name, t, len(kernel))
    strides = _per_axis(op_name, "stride", stride, n, 1)
    dilations = _per_axis(op_name, "dilation", dilation, n, 1)
    unsupported = [name for name, v in (("out_pads", out_pads), ("in_dilations", in_dilations))
                   if v and any(int(x) != (0 if name == "out_pads" else 1) for x in v)]
    if unsupported:
        raise UnsupportedError(f"op '{op_name}': {', '.join(unsupported)} other than the default are not "
                                   "supported", where=user_source_line(), fix="leave them None")
    pads = _per_axis(op_name, "padding", padding, n, 0, 2 * n)
    pads = _auto_pads(op_name, auto_pad or "not_set", pads, t.shape[2:], kernel, strides, dilations)
    return kernel, strides, pads, dilations


def max_pool(t: Tensor, kernel_size: Sequence[int], stride: Sequence[int] | None = None,
             padding: Sequence[int] | None = None, out_pads: Sequence[int] | None = None,
             dilation: Sequence[int] | None = None, in_dilations: Sequence[int] | None = None,
             auto_pad: PadType | None = "not_set", ceil_mode: bool | None = None,
             storage_order: bool | None = None) -> Tensor:
    """Max pooling (ONNX MaxPool) over ``len(kernel_size)`` spatial axes; ``stride`` defaults
    to 1 per axis (as in PopXL, not to the kernel size); padding never wins the max."""
    kernel, strides, pads, dilations = _pool_args("max_pool", t, kernel_size, stride, padding, out_pads, dilation,
                                                  in_dilations, auto_pad)
    return emit("max_pool", pool_kernels.max_pool, (t, kernel, strides, pads, dilations, bool(ceil_mode)))


def average_pool(t: Tensor, kernel_size: Sequence[int], stride: Sequence[int] | None = None,
                 padding: Sequence[int] | None = None, out_pads: Sequence[int] | None = None,
                 dilation: Sequence[int] | None = None, in_dilations: Sequence[int] | None = None,
                 auto_pad: PadType | None = "not_set", ceil_mode: bool | None = None) -> Tensor:
    """Average pooling (ONNX AveragePool, padding not counted) over ``len(kernel_size)``
    spatial axes; ``stride`` defaults to 1 per axis. Dilation other than 1 is refused."""
    kernel, strides, pads, dilations = _pool_args("average_pool", t, kernel_size, stride, padding, out_pads,
                                                  dilation, in_dilations, auto_pad)
    if any(d != 1 for d in dilations):
        raise UnsupportedError("op 'average_pool': dilation other than 1 is not supported",
                                   where=user_source_line(), fix="use dilation=None")
    return emit("average_pool", pool_kernels.average_pool, (t, kernel, strides, pads, bool(ceil_mode)))
