"""``kernels.pool.max_pool2d_with_indices`` (the device's choice for aten's max pool with
indices): bit for bit the values, indices and strides of aten's kernel, NaNs, -inf and ties
included, on the channels-last path and on the NCHW one."""
from __future__ import annotations

import pytest
import torch

from ipuxl.kernels.pool import max_pool2d_with_indices

aten = torch.ops.aten


@pytest.mark.parametrize("shape,args", [
    ((2, 16, 9, 9), ([2, 2], [2, 2])),
    ((2, 8, 10, 7), ([3, 3], [2, 2], [1, 1], [1, 1], True)),  # overlapping windows, padding, ceil
    ((1, 32, 6, 6), ([2, 3], [1, 2], [0, 1], [2, 1])),  # dilation
    ((2, 3, 6, 6), ([2, 2], [2, 2])),  # few channels: the NCHW kernel itself
])
def test_max_pool_helper_is_bitwise_the_aten_kernel(shape, args):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, shape, generator=g).float()  # many ties
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = float("-inf")
    want = aten.max_pool2d_with_indices.default(x, *args)
    got = max_pool2d_with_indices(x, *args)
    for a, b in zip(got, want):
        assert a.stride() == b.stride() and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
