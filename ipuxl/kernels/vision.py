"""Kernels of ``ipuxl.ops.vision``: ``interpolate`` (ONNX Resize) and ``roi_align`` (ONNX
RoiAlign, opset 10).

Both are written with gathers and arithmetic on index tensors computed from static
shapes, so they run as a few vectorised torch ops and are differentiable.
"""
from __future__ import annotations

import math

import torch

__all__ = ["interpolate", "roi_align"]

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


def _half_pixel_float32(out_len: int, scale: float, device: torch.device) -> torch.Tensor:
    """``(x + 0.5) / scale - 0.5`` as torch computes it for float32: ``x + 0.5`` times the float32
    inverse scale, less 0.5, clamped at 0 (where the clamp changes no value: both taps read row 0)."""
    inverse = torch.tensor(1.0 / scale, dtype=torch.float32)
    x = torch.arange(out_len, dtype=torch.float32, device=device)
    return ((x + 0.5) * inverse - 0.5).clamp(min=0)


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
    if mode == "linear" and coord_mode in ("half_pixel", "pytorch_half_pixel") and t.dtype == torch.float32:
        # in float32 as torch's (and Poplar's) linear upsampling computes it: ONNX's coordinates rounded
        # the same way, so the result matches F.interpolate to the last bit or so
        x = _half_pixel_float32(out_len, scale, t.device) if out_len > 1 or coord_mode == "half_pixel" else x.float()
    base = torch.floor(x)
    frac = x - base
    if mode == "linear":
        return take(base) * weight(1 - frac) + take(base + 1) * weight(frac)
    taps = _cubic_weights(frac)
    return sum((take(base + k - 1) * weight(w) for k, w in enumerate(taps)), torch.zeros((), dtype=t.dtype))


def interpolate(t: torch.Tensor, scales: tuple[float, ...], mode: str, nearest_mode: str,
                coord_mode: str) -> torch.Tensor:
    """ONNX Resize of ``t`` by ``scales``, one axis at a time (see ``ops.interpolate``)."""
    for axis, scale in enumerate(scales):
        out_len = math.floor(t.shape[axis] * scale)
        if out_len != t.shape[axis] or scale != 1.0:
            t = _resize_axis(t, axis, out_len, scale, mode, nearest_mode, coord_mode)
    return t


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


def roi_align(t: torch.Tensor, rois: torch.Tensor, batch_index: torch.Tensor, out_h: int, out_w: int,
              scale: float, ratio: int) -> torch.Tensor:
    """ONNX RoiAlign (opset 10, average): ``ratio`` x ``ratio`` bilinear samples per output bin
    of each RoI (see ``ops.roi_align``)."""
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
