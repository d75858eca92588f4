"""Image ops: ``interpolate`` (ONNX Resize) and ``roi_align`` (ONNX RoiAlign, opset 10).

Both are written with gathers and arithmetic on index tensors computed from static
shapes, so they run as a few vectorised torch ops and are differentiable.
"""
from __future__ import annotations

import math
from typing import Literal, Sequence

import torch

from ipuxl.errors import ShapeMismatchError, UnsupportedError
from ipuxl.ir.build import emit
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor

__all__ = ["interpolate", "roi_align", "InterpolateType", "InterpolateNearestType",
           "InterpolateCoordinateTransformationType"]

InterpolateType = Literal["nearest", "linear", "cubic"]
InterpolateNearestType = Literal["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
InterpolateCoordinateTransformationType = Literal[
    "half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize"]
_CUBIC_A = -0.75  # ONNX Resize's default cubic coefficient (torch's bicubic uses it too)


def _source_coords(length: int, out_len: int, scale: float, mode: str, device: torch.device) -> torch.Tensor:
    """ONNX Resize: the input coordinate of each output position along one axis."""
    x = torch.arange(out_len, dtype=torch.float64, device=device)
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_len > 1 else torch.zeros_like(x)
    if mode == "align_corners":
        return x * (length - 1) / (out_len - 1) if out_len > 1 else torch.zeros_like(x)
    return x / scale  # asymmetric


def _nearest_index(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "floor":
        return torch.floor(x)
    if mode == "ceil":
        return torch.ceil(x)
    frac = x - torch.floor(x)
    halfway = frac == 0.5
    rounded = torch.floor(x + 0.5)
    if mode == "round_prefer_floor":
        return torch.where(halfway, torch.floor(x), rounded)
    return rounded  # round_prefer_ceil


def _cubic_weights(t: torch.Tensor) -> list[torch.Tensor]:
    """Keys' cubic convolution weights of the 4 taps at offsets -1, 0, 1, 2 for fraction ``t``."""
    a = _CUBIC_A

    def near(d: torch.Tensor) -> torch.Tensor:
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d: torch.Tensor) -> torch.Tensor:
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _resize_axis(t: torch.Tensor, axis: int, out_len: int, scale: float, mode: str, nearest_mode: str,
                 coord_mode: str) -> torch.Tensor:
    length = t.shape[axis]
    x = _source_coords(length, out_len, scale, coord_mode, t.device)
    shape = [1] * t.dim()
    shape[axis] = out_len

    def take(i: torch.Tensor) -> torch.Tensor:
        return torch.index_select(t, axis, i.clamp(0, length - 1).long())

    def weight(w: torch.Tensor) -> torch.Tensor:
        return w.to(t.dtype).reshape(shape)

    if mode == "nearest":
        return take(_nearest_index(x, nearest_mode))
    base = torch.floor(x)
    frac = x - base
    if mode == "linear":
        return take(base) * weight(1 - frac) + take(base + 1) * weight(frac)
    taps = _cubic_weights(frac)
    return sum((take(base + k - 1) * weight(w) for k, w in enumerate(taps)), torch.zeros((), dtype=t.dtype))


def _interpolate(t: torch.Tensor, scales: tuple[float, ...], mode: str, nearest_mode: str,
                 coord_mode: str) -> torch.Tensor:
    for axis, scale in enumerate(scales):
        out_len = math.floor(t.shape[axis] * scale)
        if out_len != t.shape[axis] or scale != 1.0:
            t = _resize_axis(t, axis, out_len, scale, mode, nearest_mode, coord_mode)
    return t


def interpolate(t: Tensor, scale_factor: Sequence[float] | None = (1.0, 1.0, 1.0, 1.0),
                mode: InterpolateType | None = "nearest",
                nearest_mode: InterpolateNearestType | None = "round_prefer_floor",
                coordinate_transformation_mode: InterpolateCoordinateTransformationType | None = "half_pixel"
                ) -> Tensor:
    """Resize ``t`` (ONNX Resize with ``scales``): axis ``i`` gets ``floor(len_i * scale_factor[i])``
    positions, each read from the input coordinate ``coordinate_transformation_mode``
    gives; ``nearest`` rounds it per ``nearest_mode``, ``linear`` and ``cubic`` (coefficient
    -0.75) interpolate, clamping at the edges. Not supported: ``tf_crop_and_resize``.
    """
    scales = tuple(float(s) for s in (scale_factor or (1.0,) * t.rank))
    checks = [
        (len(scales) == t.rank, f"scale_factor {scales} needs one scale per axis of {t.shape}"),
        (all(s > 0 for s in scales), f"scale_factor {scales} must be positive"),
        (mode in ("nearest", "linear", "cubic"), f"mode {mode!r} is not nearest, linear or cubic"),
        (nearest_mode in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"),
         f"nearest_mode {nearest_mode!r} is not round_prefer_floor, round_prefer_ceil, floor or ceil"),
        (coordinate_transformation_mode in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric",
                                            "tf_crop_and_resize"),
         f"coordinate_transformation_mode {coordinate_transformation_mode!r} is not valid"),
    ]
    for ok, problem in checks:
        if not ok:
            raise ShapeMismatchError(f"op 'interpolate' of '{t.name}': {problem}", where=user_source_line(),
                                     fix="see ops.interpolate's docstring for the accepted values")
    if coordinate_transformation_mode == "tf_crop_and_resize":
        raise UnsupportedError("op 'interpolate': coordinate_transformation_mode 'tf_crop_and_resize' is not "
                               "supported (it needs a region of interest)", where=user_source_line(),
                               fix="use 'half_pixel', 'pytorch_half_pixel', 'align_corners' or 'asymmetric'")
    return emit("interpolate", _interpolate, (t, scales, mode, nearest_mode, coordinate_transformation_mode))


# -- roi_align ----------------------------------------------------------------------------------------------------
def _bilinear(feat: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Sample ``feat`` (R, C, H, W) at points ``y`` (R, P) and ``x`` (R, Q): (R, C, P, Q), zero
    outside ``[-1, size]`` and edge-clamped inside (Caffe2/ONNX RoiAlign rules)."""
    height, width = feat.shape[-2:]

    def corners(v: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = (v >= -1.0) & (v <= size)
        v = v.clamp(min=0.0)
        low = torch.floor(v).clamp(max=size - 1)
        v = torch.where(low >= size - 1, low, v)
        high = (low + 1).clamp(max=size - 1)
        frac = v - low
        return low.long(), high.long(), frac, valid

    y0, y1, fy, vy = corners(y, height)
    x0, x1, fx, vx = corners(x, width)
    rows = torch.arange(feat.shape[0], device=feat.device)[:, None, None]

    def at(yi: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        return feat[rows, :, yi[:, :, None], xi[:, None, :]].permute(0, 3, 1, 2)

    wy0, wy1 = (1 - fy)[:, None, :, None], fy[:, None, :, None]
    wx0, wx1 = (1 - fx)[:, None, None, :], fx[:, None, None, :]
    out = at(y0, x0) * wy0 * wx0 + at(y0, x1) * wy0 * wx1 + at(y1, x0) * wy1 * wx0 + at(y1, x1) * wy1 * wx1
    mask = (vy[:, :, None] & vx[:, None, :])[:, None].to(out.dtype)
    return out * mask


def _roi_align(t: torch.Tensor, rois: torch.Tensor, batch_index: torch.Tensor, out_h: int, out_w: int,
               scale: float, ratio: int) -> torch.Tensor:
    boxes = rois.to(t.dtype) * scale
    x1, y1, x2, y2 = boxes.unbind(-1)
    bin_h = (y2 - y1).clamp(min=1.0) / out_h
    bin_w = (x2 - x1).clamp(min=1.0) / out_w
    steps_y = (torch.arange(out_h * ratio, device=t.device, dtype=t.dtype) + 0.5) / ratio
    steps_x = (torch.arange(out_w * ratio, device=t.device, dtype=t.dtype) + 0.5) / ratio
    y = y1[:, None] + steps_y[None, :] * bin_h[:, None]
    x = x1[:, None] + steps_x[None, :] * bin_w[:, None]
    samples = _bilinear(t[batch_index.long()], y, x)  # (R, C, out_h * ratio, out_w * ratio)
    r, c = samples.shape[:2]
    return samples.reshape(r, c, out_h, ratio, out_w, ratio).mean(dim=(3, 5))


def roi_align(t: Tensor, rois: Tensor, batch_index: Tensor, output_size: tuple[int, int], spatial_scale: float,
              sampling_ratio: int) -> Tensor:
    """Average RoI pooling (ONNX RoiAlign, opset 10): for each RoI ``[x1, y1, x2, y2]`` of
    image ``batch_index[r]`` of ``t`` (N, C, H, W), the mean of ``sampling_ratio`` x
    ``sampling_ratio`` bilinear samples per output bin; result (num_rois, C, *output_size).

    Differs from PopXL: ``sampling_ratio`` must be positive (the adaptive 0 makes the
    sample count depend on the RoI's size at run time).
    """
    problem = None
    if t.rank != 4 or rois.rank != 2 or rois.shape[-1] != 4 or batch_index.shape != (rois.shape[0],):
        problem = (f"needs t (N, C, H, W), rois (R, 4) and batch_index (R,); got {t.shape}, {rois.shape}, "
                   f"{batch_index.shape}")
    if problem:
        raise ShapeMismatchError(f"op 'roi_align': {problem}", where=user_source_line(),
                                 fix="reshape the inputs")
    if int(sampling_ratio) <= 0:
        raise UnsupportedError(f"op 'roi_align': sampling_ratio {sampling_ratio} (adaptive) is not supported: the "
                               "sample count would depend on each RoI's size at run time", where=user_source_line(),
                               fix="pass sampling_ratio >= 1")
    out_h, out_w = (int(v) for v in output_size)
    return emit("roi_align", _roi_align, (t, rois, batch_index, out_h, out_w, float(spatial_scale),
                                         int(sampling_ratio)))
