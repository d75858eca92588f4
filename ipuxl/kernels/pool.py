"""Pooling kernels: the ones ``ops.max_pool`` and ``ops.average_pool`` record, and
``max_pool2d_with_indices``, the device's choice for ``aten.max_pool2d_with_indices``.

``max_pool2d_with_indices``: a CPU max pool with indices of a contiguous (NCHW) float
tensor with 8 or more channels runs torch's channels-last kernel, several times faster
than its NCHW one (which is not vectorised), on a channels-last copy of the input; the
results are copied back to NCHW. Values and indices are the kernel's own (the same
windows scanned in the same order: bit for bit what the NCHW kernel gives, NaNs and ties
included), so everything downstream, the backward's ``max_pool2d_with_indices_backward``
included, is unchanged. The device's ``select_kernels`` rewrite
(``ipuxl.device.rewrites.kernel_choice``) puts it in place of the aten op in compiled code.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ipuxl.kernels.conv import split_pads

__all__ = ["max_pool", "average_pool", "max_pool2d_with_indices"]

_aten = torch.ops.aten
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def max_pool(x: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], pads: tuple[int, ...],
             dilation: tuple[int, ...], ceil_mode: bool) -> torch.Tensor:
    """The kernel of ``ops.max_pool``: explicit padding is -inf, so it never wins the max."""
    padding, explicit = split_pads(pads)
    if explicit is not None:
        x = F.pad(x, explicit, value=-math.inf)
    return _MAX_POOL[len(kernel)](x, kernel, stride, padding, dilation, ceil_mode)


def average_pool(x: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], pads: tuple[int, ...],
                 ceil_mode: bool) -> torch.Tensor:
    """The kernel of ``ops.average_pool``: the average over the window's elements inside the
    input (padding is not counted)."""
    padding, explicit = split_pads(pads)
    pool = _AVG_POOL[len(kernel)]
    if explicit is None:
        return pool(x, kernel, stride, padding, ceil_mode, False)
    ones = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    total = pool(F.pad(x, explicit), kernel, stride, 0, ceil_mode, True)
    count = pool(F.pad(ones, explicit), kernel, stride, 0, ceil_mode, True)
    return total / count


_CHANNELS_LAST_POOL_DTYPES = (torch.float32, torch.float64)
_CHANNELS_LAST_POOL_MIN_CHANNELS = 8  # the channels-last kernel vectorises over channels


def max_pool2d_with_indices(x: torch.Tensor, kernel_size: Any, stride: Any = (), padding: Any = 0,
                            dilation: Any = 1, ceil_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.max_pool2d_with_indices`` with the same results (values, indices, strides),
    computed by the channels-last CPU kernel where that is faster (see the module docstring)."""
    if (x.device.type == "cpu" and x.dim() == 4 and x.dtype in _CHANNELS_LAST_POOL_DTYPES
            and x.shape[1] >= _CHANNELS_LAST_POOL_MIN_CHANNELS and x.is_contiguous()):
        out, indices = _aten.max_pool2d_with_indices.default(
            x.contiguous(memory_format=torch.channels_last), kernel_size, stride, padding, dilation, ceil_mode)
        return out.contiguous(), indices.contiguous()
    return _aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding, dilation, ceil_mode)
