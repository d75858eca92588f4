"""The vision ops (``ipuxl.ops.vision``: ``interpolate``, ``roi_align``), forward and gradient,
against eager PyTorch and torchvision."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops

from ._harness import case, check_op, randn, run_op


INTERPOLATE = [
    case("interpolate-nearest-default", lambda x: ops.interpolate(x, (1.0, 1.0, 2.0, 2.0)),
         lambda x: x.repeat_interleave(2, 2).repeat_interleave(2, 3), (1, 2, 3, 4)),
    case("interpolate-nearest-asymmetric-floor",
         lambda x: ops.interpolate(x, (1, 1, 1.5, 2.5), nearest_mode="floor",
                                   coordinate_transformation_mode="asymmetric"),
         lambda x: F.interpolate(x, scale_factor=(1.5, 2.5), mode="nearest"), (1, 2, 4, 4)),
    case("interpolate-nearest-exact", lambda x: ops.interpolate(x, (1, 1, 3.0, 0.5), nearest_mode="round_prefer_ceil"),
         lambda x: F.interpolate(x, scale_factor=(3.0, 0.5), mode="nearest-exact"), (1, 1, 3, 6)),
    case("interpolate-linear", lambda x: ops.interpolate(x, (1, 1, 2.0, 1.5), "linear"),
         lambda x: F.interpolate(x, scale_factor=(2.0, 1.5), mode="bilinear"), (2, 2, 3, 4)),
    case("interpolate-linear-align_corners",
         lambda x: ops.interpolate(x, (1, 1, 2.0, 2.0), "linear", coordinate_transformation_mode="align_corners"),
         lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=True), (1, 2, 3, 4)),
    case("interpolate-cubic", lambda x: ops.interpolate(x, (1, 1, 2.0, 2.0), "cubic"),
         lambda x: F.interpolate(x, scale_factor=2.0, mode="bicubic"), (1, 2, 4, 5)),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", INTERPOLATE)
def test_interpolate(ipuxl_fn, torch_fn, inputs, kwargs):
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


def test_interpolate_round_prefer_floor_at_halfway():
    # half_pixel with scale 2 on length 1 -> source coordinate (x + 0.5) / 2 - 0.5 of 0 and 1: -0.25, 0.25;
    # scale 0.5 on length 4 -> 0.5 and 2.5, halfway: round_prefer_floor takes 0 and 2.
    out = run_op(lambda t: ops.interpolate(t, (0.5,)), [np.arange(4.0)], grad=False)["out"][0]
    np.testing.assert_array_equal(out, [0.0, 2.0])
    out = run_op(lambda t: ops.interpolate(t, (0.5,), nearest_mode="round_prefer_ceil"), [np.arange(4.0)],
                 grad=False)["out"][0]
    np.testing.assert_array_equal(out, [1.0, 3.0])


@pytest.mark.parametrize("scale", [0.3, 0.45, 0.7])
def test_linear_downsampling_of_float32_matches_torch_to_the_last_bits(scale):
    """PopXL's own test compares with F.interpolate at rtol = atol = 1e-7 (scale 0.3). Upsampling
    stays within about 2e-7 of torch (its CPU kernel rounds the blend differently): not tested here."""
    x = np.random.default_rng(0).random((10, 10, 10)).astype(np.float32)
    got = run_op(lambda t: ops.interpolate(t, (1.0, 1.0, scale), "linear"), [x], grad=False)["out"][0]
    expected = F.interpolate(torch.from_numpy(x), scale_factor=scale, mode="linear", align_corners=False,
                             recompute_scale_factor=False)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-7, atol=1e-7)


def test_roi_align_matches_torchvision():
    tv_ops = pytest.importorskip("torchvision.ops")
    x = randn((2, 3, 8, 9))
    rois = np.array([[0.5, 1.0, 6.0, 7.5], [2.0, 0.0, 9.5, 3.0], [-1.0, -0.5, 3.0, 2.0]])
    batch = np.array([1, 0, 1], np.int32)

    def ref(t, r, b):
        return tv_ops.roi_align(t, torch.cat([b[:, None].to(t.dtype), r], 1), (3, 2), 0.75, 2, aligned=False)

    check_op(lambda t, r, b: ops.roi_align(t, r, b, (3, 2), 0.75, 2), ref, [x, rois, batch], grad_inputs=[0],
             atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("build, fragment", [
    (lambda x: ops.interpolate(x, (2.0,)), "one scale per axis"),
    (lambda x: ops.interpolate(x, mode="area"), "mode 'area'"),
    (lambda x: ops.interpolate(x, coordinate_transformation_mode="crop"), "not valid"),
    (lambda x: ops.roi_align(x, x, x, (2, 2), 1.0, 0), "needs t"),
], ids=["scales", "mode", "coords", "roi_align"])
def test_interpolate_and_roi_align_errors(build, fragment):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((1, 2, 3, 3), np.float32), name="x")
        with pytest.raises(ValueError, match=fragment):
            build(x)


@pytest.mark.parametrize("build, fragment", [
    (lambda x, r, b: ops.interpolate(x, coordinate_transformation_mode="tf_crop_and_resize"), "tf_crop_and_resize"),
    (lambda x, r, b: ops.roi_align(x, r, b, (2, 2), 1.0, 0), "sampling_ratio 0"),
], ids=["tf_crop_and_resize", "adaptive-sampling"])
def test_unsupported_options_say_so(build, fragment):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((1, 2, 3, 3), np.float32), name="x")
        r = ipuxl.variable(np.zeros((2, 4), np.float32), name="r")
        b = ipuxl.variable(np.zeros((2,), np.int32), name="b")
        with pytest.raises(NotImplementedError, match=fragment):
            build(x, r, b)
