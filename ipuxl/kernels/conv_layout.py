"""Grouped convolutions in the memory layout that runs them faster, chosen by measuring.

torch's CPU convolutions of contiguous (NCHW) tensors with ``groups > 1`` (depthwise
and grouped: MobileNet, EfficientNet, MnasNet, ShuffleNet, RegNet, ConvNeXt) take very
different times in the channels-last layout, in both directions: measured on one
thread (forward and backward, conversions included), a 7x7 depthwise convolution of
(4, 96, 16, 16) ran 3.9x faster in channels-last, a 3x3 of (4, 32, 32, 32) 2.3x, while
a 3x3 of (4, 144, 16, 16) ran 2.7x slower. No fixed rule separates them, so, as
cuDNN's benchmark mode and PopLibs' planner do, ``convolution`` and
``convolution_backward`` time both layouts on the first call with each configuration
(shapes, dtype, stride, padding, dilation, groups: at most a few milliseconds) and
keep the faster for the process. Channels-last is kept only when it is at least
``MARGIN`` times faster, so noise cannot flip a near tie.

Results: the channels-last kernel computes the same sums in another order, so values
can differ from the NCHW kernel's in the last bits (as eager PyTorch's results differ
between the two layouts); outputs are returned contiguous (NCHW), as the graph expects.
``IPUXL_CONV_LAYOUT=nchw`` turns the choice off (always NCHW).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["convolution", "convolution_backward", "choices", "MARGIN"]

MARGIN = 1.3  # channels-last must be this many times faster to be chosen
_REPEATS = 3

_aten = torch.ops.aten
_CL = torch.channels_last
_choices: dict[tuple, bool] = {}  # configuration -> channels-last is faster


def choices() -> dict[tuple, bool]:
    """The decisions made so far in this process: configuration -> channels-last chosen."""
    return dict(_choices)


def convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
                groups: int) -> torch.Tensor:
    """``aten.convolution`` in the faster layout (see the module docstring)."""
    args = (stride, padding, dilation, transposed, output_padding, groups)

    def nchw() -> torch.Tensor:
        return _aten.convolution.default(x, weight, bias, *args)

    def channels_last() -> torch.Tensor:
        out = _aten.convolution.default(x.contiguous(memory_format=_CL), weight.contiguous(memory_format=_CL),
                                        bias, *args)
        return out.contiguous()

    if not _candidate(x, weight, transposed, groups):
        return nchw()
    key = ("forward", _spec(x), _spec(weight), bias is not None, *map(_plain, args))
    return _run(key, nchw, channels_last)


def convolution_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias_sizes: Any,
                         stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                         output_padding: Sequence[int], groups: int,
                         output_mask: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.convolution_backward`` in the faster layout (see the module docstring)."""
    args = (bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask)

    def nchw() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _aten.convolution_backward.default(grad, x, weight, *args)

    def channels_last() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gi, gw, gb = _aten.convolution_backward.default(
            grad.contiguous(memory_format=_CL), x.contiguous(memory_format=_CL),
            weight.contiguous(memory_format=_CL), *args)
        return (gi.contiguous() if output_mask[0] else gi, gw.contiguous() if output_mask[1] else gw, gb)

    if not _candidate(x, weight, transposed, groups) or grad.dim() != 4:
        return nchw()
    key = ("backward", _spec(grad), _spec(x), _spec(weight), *map(_plain, args))
    return _run(key, nchw, channels_last)


def _candidate(x: torch.Tensor, weight: torch.Tensor, transposed: bool, groups: int) -> bool:
    return (groups > 1 and not transposed and x.dim() == 4 and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.float64) and weight.dtype == x.dtype
            and x.is_contiguous() and weight.is_contiguous()
            and os.environ.get("IPUXL_CONV_LAYOUT", "auto") != "nchw")


def _run(key: tuple, nchw: Callable[[], Any], channels_last: Callable[[], Any]) -> Any:
    choice = _choices.get(key)
    if choice is None:
        choice = _choices[key] = _fastest(nchw) > MARGIN * _fastest(channels_last)
    return channels_last() if choice else nchw()


def _fastest(fn: Callable[[], Any]) -> float:
    fn()  # warm-up: first-call setup (oneDNN primitive creation) is not the steady state
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _spec(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value
