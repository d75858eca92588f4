"""Seeded random ops: ``dropout``, ``random_uniform``, ``random_normal``, seed splitting.

As in PopXL, randomness is a pure function of a seed tensor (two 32-bit words,
shape ``(2,)``), so a program is reproducible and the gradient of dropout reuses
the forward mask exactly. The draws are the ``torch.ops.ipuxl.*`` custom ops of
``ipuxl.kernels.random`` (importing this module registers them; module capture
records them too). ``modify_seed_impl`` and ``offset_seed_impl`` are the kernels' seed
arithmetic, re-exported for tests and tools that replay the device's seeds.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from ipuxl.dtypes import dtype_name, from_any
from ipuxl.ir.build import emit
from ipuxl.errors import InvalidArgumentError, InvalidValueError, ShapeMismatchError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import random as kernels
from ipuxl.kernels.random import modify_seed_impl, offset_seed_impl

__all__ = ["dropout", "shaped_dropout", "random_uniform", "random_normal", "split_random_seed", "create_seeds", "modify_seed_impl",
           "offset_seed_impl", "MAX_UINT64", "uint64_to_two_uint32", "two_uint32_to_uint64"]

#: The largest seed value (PopXL's ``popxl.random_seed.MAX_UINT64``).
MAX_UINT64 = 2**64 - 1


def _check_seed(seed: Tensor) -> None:
    if seed.shape != (2,) or seed.dtype.is_floating_point:
        raise InvalidArgumentError(
            f"seed tensor '{seed.name}' must have shape (2,) and an integer dtype, got "
            f"{seed.shape} {dtype_name(seed.dtype)}", where=user_source_line(),
            fix="load a seed from ipuxl.create_seeds(...) through a uint32 h2d_stream of shape (2,)")


def dropout(t: Tensor, seed_tensor: Tensor, p: float) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)``."""
    _check_seed(seed_tensor)
    return emit("dropout", kernels.dropout, (t, seed_tensor, float(p)))


def shaped_dropout(t: Tensor, seed_tensor: Tensor, shape: Iterable[int], ratio: float) -> Tensor:
    """Dropout with a mask of ``shape`` broadcast over ``t`` (whole rows, channels... kept or
    dropped together); kept elements are scaled by ``1 / (1 - ratio)``."""
    _check_seed(seed_tensor)
    mask_shape = [int(d) for d in shape]
    try:
        torch.broadcast_shapes(tuple(mask_shape), t.shape)
        broadcasts = torch.broadcast_shapes(tuple(mask_shape), t.shape) == t.shape
    except RuntimeError:
        broadcasts = False
    if not broadcasts:
        raise ShapeMismatchError(f"op 'shaped_dropout': mask shape {tuple(mask_shape)} does not broadcast to "
                                 f"'{t.name}' {t.shape}", where=user_source_line(),
                                 fix="use 1 on the axes that share a mask value and t's size on the others")
    return emit("shaped_dropout", kernels.shaped_dropout, (t, seed_tensor, mask_shape, float(ratio)))


def random_uniform(seed_tensor: Tensor, shape: tuple[int, ...], low: float = 0.0, high: float = 1.0,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """Uniform samples in ``[low, high)``."""
    _check_seed(seed_tensor)
    return emit("random_uniform", torch.ops.ipuxl.random_uniform,
                (seed_tensor, list(shape), float(low), float(high), from_any(dtype)))


def random_normal(seed_tensor: Tensor, shape: tuple[int, ...], mean: float = 0.0, std: float = 1.0,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """Normal samples with ``mean`` and ``std``."""
    _check_seed(seed_tensor)
    return emit("random_normal", torch.ops.ipuxl.random_normal,
                (seed_tensor, list(shape), float(mean), float(std), from_any(dtype)))


def split_random_seed(seed: Tensor, n: int = 2) -> tuple[Tensor, ...]:
    """``n`` new seeds derived deterministically from ``seed``."""
    _check_seed(seed)
    return tuple(emit("split_random_seed", torch.ops.ipuxl.modify_seed, (seed, i)) for i in range(n))


def create_seeds(seed: int, offset: int = 0, batches_per_step: int = 1, gradient_accumulation_factor: int = 1,
                 replicas: int = 1) -> np.ndarray:
    """Host seeds for a seed stream: PopXL's values and shape.

    One uint64 per (batch, accumulation step, replica), drawn by
    ``numpy.random.default_rng(seed + offset)`` over the whole uint64 range and split
    into (high, low) uint32 words: shape ``(batches_per_step,
    gradient_accumulation_factor, replicas, 2)`` with size-1 dims dropped. All on the
    host in numpy (no uint32 tensor arithmetic, which torch's CPU kernels lack).
    """
    count = batches_per_step * gradient_accumulation_factor * replicas
    values = np.random.default_rng(seed + offset).integers(0, 2**64 - 1, endpoint=True, dtype=np.uint64, size=count)
    words = np.stack([values >> np.uint64(32), values & np.uint64(0xFFFFFFFF)], axis=-1).astype(np.uint32)
    shaped = words.reshape(batches_per_step, gradient_accumulation_factor, replicas, 2)
    return np.squeeze(shaped, axis=tuple(i for i, d in enumerate(shaped.shape[:-1]) if d == 1))


def uint64_to_two_uint32(num: int) -> tuple[int, int]:
    """Split a 64-bit seed into its (high, low) 32-bit words, the two elements of a seed tensor.

    Raises:
        InvalidValueError: (a ValueError, as PopXL) ``num`` is outside ``[0, MAX_UINT64]``.
    """
    if not 0 <= num <= MAX_UINT64:
        raise InvalidValueError(f"{num} is not a 64-bit unsigned integer (0 to {MAX_UINT64})", where=user_source_line(),
                                fix="use a seed in [0, popxl.random_seed.MAX_UINT64]")
    return int(num) >> 32, int(num) & 0xFFFFFFFF


def two_uint32_to_uint64(high: int, low: int) -> int:
    """The 64-bit seed whose (high, low) 32-bit words are ``high`` and ``low``."""
    return (int(high) << 32) | int(low)
