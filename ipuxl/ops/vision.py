"""Image ops: ``interpolate`` (ONNX Resize) and ``roi_align`` (ONNX RoiAlign, opset 10).

Both kernels (``ipuxl.kernels.vision``) are written with gathers and arithmetic on index
tensors computed from static shapes, so they run as a few vectorised torch ops and are
differentiable.
"""
from __future__ import annotations

from typing import Literal, Sequence

from ipuxl.errors import ShapeMismatchError, UnsupportedError
from ipuxl.ir.build import emit
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import vision as kernels

__all__ = ["interpolate", "roi_align", "InterpolateType", "InterpolateNearestType",
           "InterpolateCoordinateTransformationType"]

InterpolateType = Literal["nearest", "linear", "cubic"]
InterpolateNearestType = Literal["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
InterpolateCoordinateTransformationType = Literal[
    "half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize"]


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
    return emit("interpolate", kernels.interpolate, (t, scales, mode, nearest_mode, coordinate_transformation_mode))


# -- roi_align ----------------------------------------------------------------------------------------------------
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
    return emit("roi_align", kernels.roi_align, (t, rois, batch_index, out_h, out_w, float(spatial_scale),
                                         int(sampling_ratio)))
