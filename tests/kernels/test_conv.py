"""``kernels.conv.convolution_backward`` (the device's choice for aten's convolution
backward): small pointwise convolutions' gradients and small-output weight gradients as GEMMs,
5x5-and-larger depthwise weight gradients as a convolution, then the bias gradient as a sum;
checked against aten in float64 for every output mask, NCHW and channels-last."""
from __future__ import annotations

import pytest
import torch

from ipuxl.kernels import conv as conv_kernels
from ipuxl.kernels.conv import convolution_backward

aten = torch.ops.aten


# (batch, channels, h, w, out channels, kernel, stride, padding, dilation, groups)
CONVOLUTIONS = [
    (4, 32, 2, 2, 16, 3, 1, 1, 1, 1),  # 16 output positions: the GEMM weight gradient
    (4, 16, 4, 4, 24, 3, 2, 1, 1, 1),  # strided down to 2x2
    (2, 16, 2, 2, 8, 1, 1, 0, 1, 1),  # 1x1
    (1, 6, 6, 6, 4, 3, 2, 2, 2, 1),  # dilated, padded
    (4, 24, 2, 2, 24, 7, 1, 3, 1, 24),  # depthwise 7x7: the weight gradient as a convolution
    (2, 12, 9, 9, 12, 5, 2, 2, 1, 12),  # depthwise 5x5, strided
    (3, 8, 11, 10, 8, 5, 2, 4, 2, 8),  # depthwise, strided and dilated (taps cropped)
    (2, 8, 9, 9, 16, 3, 1, 1, 1, 2),  # grouped: aten's gradients
    (2, 8, 12, 12, 16, 3, 1, 1, 1, 1),  # large output: aten's weight gradient
    (4, 24, 8, 8, 40, 1, 1, 0, 1, 1),  # small pointwise: both gradients as GEMMs
    (2, 64, 16, 16, 128, 1, 1, 0, 1, 1),  # large pointwise: aten's
]
MASKS = [[True, True, True], [False, True, True], [True, True, False], [False, True, False], [True, False, True],
         [False, False, True], [True, False, False]]


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("conv", CONVOLUTIONS, ids=str)
def test_convolution_backward_equals_aten(conv, channels_last):
    n, c, h, w, k, r, stride, pad, dil, groups = conv
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, c, h, w, dtype=torch.float64, generator=gen)
    weight = torch.randn(k, c // groups, r, r, dtype=torch.float64, generator=gen)
    if channels_last:
        x, weight = (t.contiguous(memory_format=torch.channels_last) for t in (x, weight))
    grad = torch.randn_like(torch.nn.functional.conv2d(x, weight, None, stride, pad, dil, groups))
    for mask in MASKS:
        args = (grad, x, weight, [k], [stride] * 2, [pad] * 2, [dil] * 2, False, [0, 0], groups, mask)
        want, got = aten.convolution_backward.default(*args), convolution_backward(*args)
        for i, (a, b) in enumerate(zip(want, got)):
            assert (a is None) == (b is None) == (not mask[i])
            if a is not None:
                torch.testing.assert_close(b, a, msg=lambda m, i=i, mask=mask: f"output {i} of mask {mask}: {m}")
                assert b.shape == a.shape and b.dtype == a.dtype


def test_convolution_backward_paths(monkeypatch):
    """Which weight gradient each convolution gets (the speed rules of ``kernels.conv``)."""
    picked = []
    for name in ("_weight_gradient_gemm", "_weight_gradient_depthwise", "_pointwise_backward"):
        real = getattr(conv_kernels, name)
        monkeypatch.setattr(conv_kernels, name, lambda *a, real=real, name=name: picked.append(name) or real(*a))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the rules for several threads
    for conv in CONVOLUTIONS:
        n, c, h, w, k, r, stride, pad, dil, groups = conv
        x, weight = torch.randn(n, c, h, w), torch.randn(k, c // groups, r, r)
        grad = torch.randn_like(torch.nn.functional.conv2d(x, weight, None, stride, pad, dil, groups))
        convolution_backward(grad, x, weight, [k], [stride] * 2, [pad] * 2, [dil] * 2, False, [0, 0], groups,
                             [True, True, True])
    assert picked == ["_weight_gradient_gemm"] * 4 + ["_weight_gradient_depthwise"] * 3 + ["_pointwise_backward"]
