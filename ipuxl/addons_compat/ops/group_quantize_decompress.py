"""popxl.addons' 4-bit group quantisation ("FlexGen", arXiv:2303.06865).

A weight is grouped along one axis; each group of ``group_size`` values is stored as
4-bit integers ``round((x - min) / scale)`` with ``scale = (max - min) / 15`` (float16),
four to a uint16 element, most significant nibble first. ``group_quantize_decompress``
unpacks and rescales on the device; the numpy functions compress and decompress on the
host, as upstream's.
"""
from __future__ import annotations

import numpy as np
import torch

from ipuxl.errors import InvalidValueError, ShapeMismatchError, UnsupportedError
from ipuxl.ir import context
from ipuxl.ir.build import emit
from ipuxl.ir.graph import describe
from ipuxl.ir.tensor import Tensor

__all__ = ["group_quantize_decompress", "group_quantize_decompress_numpy", "group_quantize_compress_numpy"]


def group_quantize_decompress(t: Tensor, group_scale: Tensor, group_bias: Tensor, dim: int = -1) -> Tensor:
    """Unpack and rescale a group-quantised tensor.

    Args:
        t: the packed values, uint16 ``(rows, groups, group_size // 4)``.
        group_scale: ``(rows, groups, 1)`` (or ``(rows, groups)``), the scale of each group.
        group_bias: the same shape, the minimum of each group.
        dim: where the decompressed axis goes (default last).

    Returns:
        ``(rows, groups * group_size)`` in the scale's dtype, the decompressed axis moved to ``dim``.

    Raises:
        UnsupportedError: (a NotImplementedError, as upstream) ``t`` is not 3-D.
        ShapeMismatchError: (a ValueError) the scale or bias do not match ``t``'s leading axes.
    """
    if t.rank != 3:
        raise UnsupportedError(f"4-bit decompression currently supported only for packed tensors with rank 3, got "
                               f"{describe(t)}", where=context.user_source_line(),
                               fix="pack the weight as (rows, groups, group_size // 4)")
    terms = []
    for name, term in (("group_scale", group_scale), ("group_bias", group_bias)):
        if term.rank == t.rank - 1:
            term = term.reshape((*term.shape, 1))
        if term.rank != t.rank or term.shape[:2] != t.shape[:2]:
            raise ShapeMismatchError(f"group_quantize_decompress: {name} {describe(term)} must be (rows, groups, 1) "
                                     f"for {describe(t)}", where=context.user_source_line(),
                                     fix="give one scale and one bias per group")
        terms.append(term)
    return emit("group_quantize_decompress", _decompress, (t, terms[0], terms[1], dim), name="t_decompressed")


def _decompress(t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, dim: int) -> torch.Tensor:
    packed = t.to(torch.int32)  # torch has no shifts on uint16
    nibbles = torch.stack([(packed >> s) & 15 for s in (12, 8, 4, 0)], -1)
    values = nibbles.reshape(*t.shape[:-1], t.shape[-1] * 4).to(scale.dtype) * scale + bias
    out = values.reshape(*t.shape[:-2], -1)
    return out.movedim(-1, dim) if dim != -1 else out


def group_quantize_decompress_numpy(t: np.ndarray, group_scale: np.ndarray, group_bias: np.ndarray,
                                    dim: int) -> np.ndarray:
    """The host version of ``group_quantize_decompress`` (float16 result)."""
    leading, (groups, ids) = t.shape[:-2], t.shape[-2:]
    nibbles = np.stack([(t >> s) & 15 for s in (12, 8, 4, 0)], -1).reshape(*leading, groups, ids * 4)
    values = (nibbles.astype(np.float16) * group_scale + group_bias).reshape(*leading, groups * ids * 4)
    return np.moveaxis(values, -1, dim) if dim != -1 else values


def group_quantize_compress_numpy(t: np.ndarray, group_size: int,
                                  dim: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compress ``t`` along ``dim`` in groups of ``group_size``: ``(packed uint16 (..., groups,
    group_size // 4), scale float16 (..., groups, 1), bias float16 (..., groups, 1))``, the
    compressed axis moved last.

    Raises:
        InvalidValueError: (a ValueError, as upstream) ``t`` holds non-finite values.
    """
    if dim != -1:
        t = np.moveaxis(t, dim, -1)
    if not np.isfinite(t).all():
        raise InvalidValueError("Cannot compress t which contains non-finite values", where=context.user_source_line(),
                                fix="replace inf and nan before quantising")
    leading, groups = t.shape[:-1], t.shape[-1] // group_size
    grouped = t.reshape(*leading, groups, group_size)
    t_max = grouped.max(-1, keepdims=True).astype(np.float16)
    t_min = grouped.min(-1, keepdims=True).astype(np.float16)
    scale = (t_max - t_min) / (2**4 - 1)
    quantised = np.round((grouped - t_min) / scale).astype(np.uint16)
    weights = (2 ** (np.arange(4) * 4)[::-1]).astype(np.uint16)
    packed = quantised.reshape(*leading, groups, group_size // 4, 4) @ weights
    return packed.astype(np.uint16), scale, t_min
