"""Convolution kernels: the forward convolutions ``ops.conv`` and ``ops.conv_transpose``
record, and ``convolution_backward``, the device's choice for ``aten.convolution_backward``.

``conv`` and ``conv_transpose`` take PopXL's padding, ``(begin_0, ..., end_0, ...)``:
symmetric padding is torch's per-axis padding, asymmetric padding pads the input
explicitly first (``split_pads``).

``convolution_backward`` computes the gradients oneDNN is slow at on the CPU (small
pointwise convolutions, small-output and large-kernel depthwise weight gradients) with
GEMMs or a convolution; every other convolution gets aten's kernel, bit for bit. The
device's ``select_kernels`` rewrite (``ipuxl.device.rewrites.kernel_choice``) puts it in
place of ``aten.convolution_backward`` in compiled code.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

__all__ = ["conv", "conv_transpose", "split_pads", "convolution_backward", "GEMM_WEIGHT_GRADIENT_MAX_POSITIONS",
           "POINTWISE_GEMM_MAX_WORK", "POINTWISE_GEMM_MIN_POSITIONS_NCHW", "DEPTHWISE_CONV_WEIGHT_GRADIENT_MIN_TAPS"]

_aten = torch.ops.aten
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def split_pads(pads: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Symmetric pads as torch's per-axis padding, else (zeros, F.pad's list: last axis first)."""
    n = len(pads) // 2
    begin, end = pads[:n], pads[n:]
    if begin == end:
        return begin, None
    explicit = [p for axis in reversed(range(n)) for p in (begin[axis], end[axis])]
    return (0,) * n, tuple(explicit)


def conv(x: torch.Tensor, w: torch.Tensor, stride: tuple[int, ...], pads: tuple[int, ...],
         dilation: tuple[int, ...], groups: int) -> torch.Tensor:
    """The kernel of ``ops.conv``: ``x`` convolved with ``w`` (no bias), PopXL's pads."""
    padding, explicit = split_pads(pads)
    if explicit is not None:
        x = F.pad(x, explicit)
    return _CONV[w.dim() - 2](x, w, None, stride, padding, dilation, groups)


def conv_transpose(x: torch.Tensor, w: torch.Tensor, stride: tuple[int, ...], pads: tuple[int, ...],
                   output_padding: tuple[int, ...], dilation: tuple[int, ...], groups: int) -> torch.Tensor:
    """The kernel of ``ops.conv_transpose``: the full transposed convolution, cropped by the pads."""
    n = w.dim() - 2
    out = _CONV_T[n](x, w, None, stride, 0, output_padding, groups, dilation)
    index = [slice(None), slice(None)] + [slice(b, out.shape[2 + i] - e) for i, (b, e) in
                                          enumerate(zip(pads[:n], pads[n:]))]
    return out[tuple(index)].contiguous()


#: the weight gradient of a 2-D convolution whose output has at most this many positions over the
#: whole batch (N x Ho x Wo) is one GEMM (see ``convolution_backward``)
GEMM_WEIGHT_GRADIENT_MAX_POSITIONS = 16
#: a pointwise convolution's gradients are GEMMs when out x in channels x output positions is at
#: most this (above it oneDNN's kernels are as fast), NCHW ones only from this many positions
#: and at several threads
POINTWISE_GEMM_MAX_WORK = 4_000_000
POINTWISE_GEMM_MIN_POSITIONS_NCHW = 64
#: the weight gradient of a depthwise 2-D convolution with at least this many taps is a convolution
DEPTHWISE_CONV_WEIGHT_GRADIENT_MIN_TAPS = 25


def convolution_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias_sizes: Any,
                         stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                         output_padding: Sequence[int], groups: int, output_mask: Sequence[bool]) -> tuple[Any, ...]:
    """``aten.convolution_backward``, with gradients computed another way where oneDNN's
    kernels are slow (CPU, untransposed 2-D convolutions):

    * a small pointwise convolution (``_pointwise_by_gemm``): both gradients as GEMMs;
    * ungrouped, at most ``GEMM_WEIGHT_GRADIENT_MAX_POSITIONS`` output positions in all (the
      last stages of an ImageNet CNN at small images or batches: for 512x512x3x3 at 2x2 and
      batch 4 oneDNN takes ~10x the forward's time): one GEMM, ``grad_output (K, N*L) @
      unfold(input) (N*L, C*kh*kw)``, about the forward's time (1x1 convolutions at one
      thread only from 8 positions, below which oneDNN's is as fast);
    * depthwise with ``DEPTHWISE_CONV_WEIGHT_GRADIENT_MIN_TAPS`` taps or more: one depthwise
      convolution (``_weight_gradient_depthwise``).

    For the last two the input gradient is oneDNN's alone, and always the bias gradient a sum (oneDNN's bias
    gradient without the weight's is slow). Values: the same products, summed in another
    order (float32 rounding, ~1e-7 relative); every other convolution is aten's, bit for bit.
    """
    mask = list(output_mask)
    if not _is_plain_cpu_conv2d(x, transposed):
        return _aten.convolution_backward.default(grad_output, x, weight, bias_sizes, stride, padding, dilation,
                                                  transposed, output_padding, groups, output_mask)
    if _pointwise_by_gemm(grad_output, x, weight, stride, padding, groups):
        return _pointwise_backward(grad_output, x, weight, mask)
    weight_gradient = None
    if mask[1] and _gemm_weight_gradient(grad_output, weight, groups):
        weight_gradient = _weight_gradient_gemm
    elif mask[1] and _depthwise_weight_gradient(x, weight, groups):
        weight_gradient = _weight_gradient_depthwise
    if weight_gradient is None:
        return _aten.convolution_backward.default(grad_output, x, weight, bias_sizes, stride, padding, dilation,
                                                  transposed, output_padding, groups, output_mask)
    grad_input = grad_bias = None
    if mask[0]:
        grad_input = _aten.convolution_backward.default(grad_output, x, weight, bias_sizes, stride, padding,
                                                        dilation, transposed, output_padding, groups,
                                                        [True, False, False])[0]
    if mask[2]:  # oneDNN's bias gradient without the weight's is slow (10 ms for 768 channels at 2x2)
        grad_bias = grad_output.sum((0, 2, 3))
    grad_weight = weight_gradient(grad_output, x, tuple(weight.shape), list(stride), list(padding),
                                  list(dilation)).contiguous(memory_format=_memory_format_of(weight))
    return grad_input, grad_weight, grad_bias


def _pointwise_by_gemm(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                       padding: Sequence[int], groups: int) -> bool:
    """A small pointwise (1x1, stride 1, unpadded, ungrouped) convolution, both tensors
    channels-last, or NCHW at several threads: oneDNN's backward costs up to ~2x two GEMMs there."""
    if tuple(weight.shape[2:]) != (1, 1) or list(stride) != [1, 1] or list(padding) != [0, 0] or groups != 1:
        return False
    positions = grad_output.numel() // grad_output.shape[1]
    if weight.shape[0] * weight.shape[1] * positions > POINTWISE_GEMM_MAX_WORK:
        return False
    if _channels_last(x) and _channels_last(grad_output):
        return True
    # NCHW: only where oneDNN splits the small convolution over threads (at one thread it is faster)
    return (x.is_contiguous() and grad_output.is_contiguous() and positions >= POINTWISE_GEMM_MIN_POSITIONS_NCHW
            and torch.get_num_threads() > 1)


def _channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last)


def _pointwise_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        mask: list[bool]) -> tuple[Any, ...]:
    """A pointwise convolution's gradients as GEMMs: ``dW = g^T x`` and ``dx = g W`` over the
    (batch x position, channel) matrices, in the tensors' own layout (no copies channels-last)."""
    n, k, h, w = grad_output.shape
    c = x.shape[1]
    matrix = weight.reshape(k, c)
    grad_input = grad_weight = grad_bias = None
    if _channels_last(x) and _channels_last(grad_output):
        g2, x2 = grad_output.permute(0, 2, 3, 1).reshape(-1, k), x.permute(0, 2, 3, 1).reshape(-1, c)
        if mask[0]:
            grad_input = torch.mm(g2, matrix).view(n, h, w, c).permute(0, 3, 1, 2)
        if mask[1]:
            grad_weight = torch.mm(g2.t(), x2)
    else:
        g3, x3 = grad_output.reshape(n, k, h * w), x.reshape(n, c, h * w)
        if mask[0]:
            grad_input = torch.matmul(matrix.t(), g3).view(n, c, h, w)
        if mask[1]:
            grad_weight = torch.mm(g3.transpose(0, 1).reshape(k, -1), x3.transpose(1, 2).reshape(-1, c))
    if grad_weight is not None:
        grad_weight = grad_weight.view(weight.shape).contiguous(memory_format=_memory_format_of(weight))
    if mask[2]:
        grad_bias = grad_output.sum((0, 2, 3))
    return grad_input, grad_weight, grad_bias


def _weight_gradient_gemm(grad_output: torch.Tensor, x: torch.Tensor, shape: tuple[int, ...], stride: list[int],
                          padding: list[int], dilation: list[int]) -> torch.Tensor:
    """An ungrouped convolution's weight gradient as one GEMM over the unfolded input."""
    n, k = grad_output.shape[:2]
    kernel = shape[2:]
    if kernel == (1, 1) and stride == [1, 1] and padding == [0, 0]:
        columns = x.reshape(n, x.shape[1], -1)
    else:
        # (N, C*kh*kw, L)
        columns = torch.nn.functional.unfold(x, kernel, tuple(dilation), tuple(padding), tuple(stride))
    positions = columns.shape[-1]
    grads = grad_output.reshape(n, k, positions).transpose(0, 1).reshape(k, n * positions)
    return torch.mm(grads, columns.transpose(1, 2).reshape(n * positions, -1)).view(shape)


def _weight_gradient_depthwise(grad_output: torch.Tensor, x: torch.Tensor, shape: tuple[int, ...],
                               stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
    """A depthwise convolution's weight gradient as one depthwise convolution of the input by
    the output gradient (each image and channel its own group), summed over the batch: tap
    (i, j) of channel c is sum over n, h, w of x_padded[n, c, s*h + d*i, s*w + d*j] * g[n, c, h, w]."""
    n, c = x.shape[:2]
    images = x.transpose(0, 1).reshape(1, c * n, *x.shape[2:])
    kernels = grad_output.transpose(0, 1).reshape(c * n, 1, *grad_output.shape[2:])
    taps = torch.nn.functional.conv2d(images, kernels, None, dilation, padding, stride, c * n)
    return taps[0, :, :shape[2], :shape[3]].reshape(c, n, shape[2], shape[3]).sum(1).view(shape)


def _is_plain_cpu_conv2d(x: torch.Tensor, transposed: bool) -> bool:
    return not transposed and x.device.type == "cpu" and x.dim() == 4 and x.dtype in (torch.float32, torch.float64)


def _gemm_weight_gradient(grad_output: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    positions = grad_output.numel() // grad_output.shape[1]
    if groups != 1 or positions > GEMM_WEIGHT_GRADIENT_MAX_POSITIONS:
        return False
    return weight.shape[2] * weight.shape[3] > 1 or positions >= 8 or torch.get_num_threads() > 1


def _depthwise_weight_gradient(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """Depthwise (one filter per channel) with a kernel of 5x5 taps or more: oneDNN's weight
    gradient there is 3-25x slower than the convolution that computes it."""
    return groups == x.shape[1] == weight.shape[0] and weight.shape[1] == 1 and \
        weight.shape[2] * weight.shape[3] >= DEPTHWISE_CONV_WEIGHT_GRADIENT_MIN_TAPS


def _memory_format_of(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 and not t.is_contiguous() and \
        t.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
