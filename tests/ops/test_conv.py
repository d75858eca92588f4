"""Convolution and pooling (``ipuxl.ops.conv``), forward and gradient, against eager PyTorch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops

from ._harness import case, check_op


def _pad(x, pads, value=0.0):
    n = len(pads) // 2
    return F.pad(x, [p for a in reversed(range(n)) for p in (pads[a], pads[n + a])], value=value)


def _avg_pool_ref(x, kernel, stride, pads, ceil_mode=False):
    """ONNX AveragePool without counting padding: the mean of the window's input elements."""
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[len(kernel)]
    ones = torch.ones_like(x)
    total = pool(_pad(x, pads), kernel, stride, 0, ceil_mode, True)
    return total / pool(_pad(ones, pads), kernel, stride, 0, ceil_mode, True)


CONV = [
    case("conv1d", lambda x, w: ops.conv(x, w, (2,), (1, 1)), lambda x, w: F.conv1d(x, w, None, 2, 1),
         (2, 3, 9), (4, 3, 3)),
    case("conv1d-defaults", ops.conv, F.conv1d, (2, 3, 9), (4, 3, 3)),
    case("conv3d", lambda x, w: ops.conv(x, w, (1, 2, 1), (1, 0, 1, 1, 0, 1)),
         lambda x, w: F.conv3d(x, w, None, (1, 2, 1), (1, 0, 1)), (1, 2, 4, 5, 4), (3, 2, 2, 3, 2)),
    case("conv-asymmetric-padding", lambda x, w: ops.conv(x, w, padding=(0, 1, 2, 1)),
         lambda x, w: F.conv2d(_pad(x, (0, 1, 2, 1)), w), (1, 2, 5, 5), (3, 2, 3, 3)),
    case("conv-positional-groups-dilation", lambda x, w: ops.conv(x, w, (1, 1), (0, 0, 0, 0), (2, 1), 2, "not_set",
                                                                  [0.5]),
         lambda x, w: F.conv2d(x, w, None, 1, 0, (2, 1), 2), (1, 4, 7, 6), (2, 2, 2, 2)),
    case("conv-same_upper", lambda x, w: ops.conv(x, w, (2, 2), pad_type="same_upper"),
         lambda x, w: F.conv2d(_pad(x, (0, 0, 1, 1)), w, None, 2), (1, 2, 6, 5), (3, 2, 3, 2)),
    case("conv-same_lower", lambda x, w: ops.conv(x, w, (2, 2), pad_type="same_lower"),
         lambda x, w: F.conv2d(_pad(x, (1, 1, 0, 0)), w, None, 2), (1, 2, 6, 5), (3, 2, 3, 2)),
    case("conv-valid", lambda x, w: ops.conv(x, w, padding=(1, 1, 1, 1), pad_type="valid"), F.conv2d,
         (1, 2, 5, 5), (3, 2, 3, 3)),
    case("conv_transpose", ops.conv_transpose, F.conv_transpose2d, (2, 3, 4, 5), (3, 2, 3, 3)),
    case("conv_transpose-stride-pad-outpad", lambda x, w: ops.conv_transpose(x, w, (2, 2), (1, 0, 1, 0),
                                                                             output_padding=(1, 1)),
         lambda x, w: F.conv_transpose2d(x, w, None, 2, (1, 0), (1, 1)), (1, 3, 4, 4), (3, 2, 3, 3)),
    case("conv_transpose-asymmetric", lambda x, w: ops.conv_transpose(x, w, padding=(1, 0, 0, 2)),
         lambda x, w: F.conv_transpose2d(x, w)[:, :, 1:, :-2], (1, 2, 4, 5), (2, 2, 3, 3)),
    case("conv_transpose-groups-dilation-1d", lambda x, w: ops.conv_transpose(x, w, (2,), (0, 0), (2,), 2),
         lambda x, w: F.conv_transpose1d(x, w, None, 2, 0, 0, 2, 2), (1, 4, 5), (4, 3, 3)),
    case("conv_transpose-output_shape", lambda x, w: ops.conv_transpose(x, w, (2, 2), output_shape=(8, 7)),
         lambda x, w: F.conv_transpose2d(x, w, None, 2)[:, :, 0:8, 0:7], (1, 2, 4, 4), (2, 3, 2, 2)),
    case("max_pool-padding-ceil", lambda x: ops.max_pool(x, (3, 3), (2, 2), (1, 1, 1, 1), ceil_mode=True),
         lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True), (1, 2, 6, 7)),
    case("max_pool-asymmetric", lambda x: ops.max_pool(x, (2, 2), (2, 2), (1, 0, 0, 1)),
         lambda x: F.max_pool2d(_pad(x, (1, 0, 0, 1), -np.inf), 2, 2), (1, 2, 5, 5)),
    case("max_pool-dilation-1d", lambda x: ops.max_pool(x, (2,), (1,), dilation=(2,)),
         lambda x: F.max_pool1d(x, 2, 1, dilation=2), (2, 3, 8)),
    case("max_pool-3d", lambda x: ops.max_pool(x, (2, 2, 2), (2, 1, 2)),
         lambda x: F.max_pool3d(x, 2, (2, 1, 2)), (1, 2, 4, 4, 4)),
    case("max_pool-same_upper", lambda x: ops.max_pool(x, (3, 3), (2, 2), auto_pad="same_upper"),
         lambda x: F.max_pool2d(_pad(x, (0, 1, 1, 1), -np.inf), 3, 2), (1, 1, 6, 5)),
    case("average_pool-padding-not-counted", lambda x: ops.average_pool(x, (3, 3), (2, 2), (1, 1, 1, 1)),
         lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), (1, 2, 7, 6)),
    case("average_pool-asymmetric", lambda x: ops.average_pool(x, (2, 3), (1, 2), (0, 1, 1, 0)),
         lambda x: _avg_pool_ref(x, (2, 3), (1, 2), (0, 1, 1, 0)), (1, 2, 5, 6)),
    case("average_pool-ceil-1d", lambda x: ops.average_pool(x, (2,), (2,), ceil_mode=True),
         lambda x: F.avg_pool1d(x, 2, 2, ceil_mode=True), (2, 3, 7)),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", CONV)
def test_conv_and_pool(ipuxl_fn, torch_fn, inputs, kwargs):
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


def test_pool_output_shapes_for_stride_other_than_kernel():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((1, 1, 7, 7), np.float32))
        assert ops.max_pool(x, (3, 3)).shape == (1, 1, 5, 5)  # stride defaults to 1, not the kernel
        assert ops.max_pool(x, (3, 3), (2, 2)).shape == (1, 1, 3, 3)
        assert ops.average_pool(x, (2, 2), (2, 2), ceil_mode=True).shape == (1, 1, 4, 4)


@pytest.mark.parametrize("build, error, fragment", [
    (lambda x, w: ops.conv(x, w, pad_type="same"), ValueError, "pad type 'same'"),
    (lambda x, w: ops.conv(x, w, stride=(1, 2, 3)), ValueError, "needs 2 values"),
    (lambda x, w: ops.max_pool(x, (2, 2), out_pads=(1, 1, 1, 1)), NotImplementedError, "out_pads"),
    (lambda x, w: ops.average_pool(x, (2, 2), dilation=(2, 2)), NotImplementedError, "dilation"),
    (lambda x, w: ops.max_pool(x, (2, 2, 2)), ValueError, "3 spatial axes"),
], ids=["pad-type", "stride-length", "out_pads", "avg-dilation", "rank"])
def test_conv_and_pool_errors(build, error, fragment):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((1, 2, 5, 5), np.float32), name="x")
        w = ipuxl.variable(np.zeros((3, 2, 3, 3), np.float32), name="w")
        with pytest.raises(error, match=fragment):
            build(x, w)
