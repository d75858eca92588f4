"""popxl.addons' rotary positional embeddings (RoPE, "RoFormer", arXiv:2104.09864).

``rotary_pos_embed(t, sin, cos, rotary_dim)`` rotates the first ``rotary_dim`` features
of each head of ``t`` (batch, seq, heads, head_size) by position-dependent angles: the
features are pairs ``(x[2i], x[2i+1])`` (real, imaginary), pair ``i`` at position ``m``
rotated by ``m * base**(-2i / rotary_dim)``. Its gradient is the rotation by the opposite
angles, as upstream's grad op (autodiff derives it from the same expression).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ipuxl.dtypes import DTypeLike, float32, from_any, to_numpy_dtype
from ipuxl.errors import ShapeMismatchError
from ipuxl.ir import context
from ipuxl.ir.build import emit
from ipuxl.ir.graph import describe
from ipuxl.ir.graph_builder import constant
from ipuxl.ir.tensor import Tensor

__all__ = ["rotary_pos_embed", "trig_tables", "trig_table_constants"]


def trig_tables(seq_len: int, rotary_dim: int, base: int = 10000,
                np_dtype: Any = "float32") -> tuple[np.ndarray, np.ndarray]:
    """``(sin, cos)`` of the angles ``m * base**(-2i / rotary_dim)``, each ``(seq_len, rotary_dim // 2)``."""
    theta = base ** (-np.arange(0, rotary_dim, 2).astype(np_dtype) / rotary_dim)
    phi = np.outer(np.arange(seq_len).astype(np_dtype), theta)
    return np.sin(phi), np.cos(phi)


def trig_table_constants(seq_len: int, rotary_dim: int, base: int = 10000,
                         dtype: DTypeLike = float32) -> tuple[Tensor, Tensor]:
    """``trig_tables`` as two constants of ``dtype`` in the current graph."""
    sin, cos = trig_tables(seq_len, rotary_dim, base, to_numpy_dtype(from_any(dtype)))
    return constant(sin, dtype), constant(cos, dtype)


def rotary_pos_embed(t: Tensor, sin: Tensor, cos: Tensor, rotary_dim: int | None = None) -> Tensor:
    """``t`` (batch, seq, heads, head_size) with its first ``rotary_dim`` features of each head
    rotated (default: all), by ``sin``/``cos`` tables of ``trig_tables``.

    Raises:
        ShapeMismatchError: ``t`` is not 4-D, or the tables are not ``(seq, rotary_dim // 2)``
            (optionally with a leading 1).
    """
    rotary_dim = rotary_dim or t.shape[-1]
    tables = [(s if s.rank == 3 else s.reshape((1, *s.shape))) for s in (sin, cos)]
    expected = (1, t.shape[1] if t.rank == 4 else -1, rotary_dim // 2)
    if t.rank != 4 or rotary_dim % 2 or rotary_dim > t.shape[-1] or any(s.shape != expected for s in tables):
        raise ShapeMismatchError(
            f"rotary_pos_embed: needs t (batch, seq, heads, head_size) and sin, cos (seq, rotary_dim / 2) with an even "
            f"rotary_dim <= head_size; got {describe(t)}, {describe(sin)}, {describe(cos)}, rotary_dim {rotary_dim}",
            where=context.user_source_line(), fix="make the tables with trig_table_constants(seq_len, rotary_dim)")
    return emit("rotary_pos_embed", _rotate, (t, tables[0], tables[1], rotary_dim), name="t_rotated")


def _rotate(t: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    pairs = t[..., :rotary_dim].reshape(*t.shape[:3], rotary_dim // 2, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    sin, cos = sin.unsqueeze(2), cos.unsqueeze(2)  # (1, seq, 1, rotary_dim / 2): broadcast over batch and heads
    rotated = torch.stack((real * cos - imag * sin, imag * cos + real * sin), -1).reshape(*t.shape[:3], rotary_dim)
    return torch.cat((rotated, t[..., rotary_dim:]), -1) if rotary_dim < t.shape[-1] else rotated
