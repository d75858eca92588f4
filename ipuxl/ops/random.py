"""Seeded random ops: ``dropout``, ``random_uniform``, ``random_normal``, seed splitting.

As in PopXL, randomness is a pure function of a seed tensor (two 32-bit words,
shape ``(2,)``), so a program is reproducible and the gradient of dropout reuses
the forward mask exactly. The draws are the ``torch.ops.ipuxl.*`` custom ops of
``ipuxl.kernels.random`` (importing this module registers them; module capture
records them too). ``modify_seed_impl`` and ``offset_seed_impl`` are the kernels' seed
arithmetic, re-exported for tests and tools that replay the device's seeds.
"""
from __future__ import annotations

import numpy as np
import torch

from ipuxl.ir.build import emit
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import random as kernels
from ipuxl.kernels.random import modify_seed_impl, offset_seed_impl

__all__ = ["dropout", "random_uniform", "random_normal", "split_random_seed", "create_seeds", "modify_seed_impl",
           "offset_seed_impl"]


def _check_seed(seed: Tensor) -> None:
    if seed.shape != (2,) or seed.dtype.is_floating_point:
        raise InvalidArgumentError(
            f"seed tensor '{seed.name}' must have shape (2,) and an integer dtype, got "
            f"{seed.shape} {seed.dtype}", where=user_source_line(),
            fix="load a seed from ipuxl.create_seeds(...) through a uint32 h2d_stream of shape (2,)")


def dropout(t: Tensor, seed_tensor: Tensor, p: float) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)``."""
    _check_seed(seed_tensor)
    return emit("dropout", kernels.dropout, (t, seed_tensor, float(p)))


def random_uniform(seed_tensor: Tensor, shape: tuple[int, ...], low: float = 0.0, high: float = 1.0,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """Uniform samples in ``[low, high)``."""
    _check_seed(seed_tensor)
    return emit("random_uniform", torch.ops.ipuxl.random_uniform,
                (seed_tensor, list(shape), float(low), float(high), dtype))


def random_normal(seed_tensor: Tensor, shape: tuple[int, ...], mean: float = 0.0, std: float = 1.0,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """Normal samples with ``mean`` and ``std``."""
    _check_seed(seed_tensor)
    return emit("random_normal", torch.ops.ipuxl.random_normal,
                (seed_tensor, list(shape), float(mean), float(std), dtype))


def split_random_seed(seed: Tensor, n: int = 2) -> tuple[Tensor, ...]:
    """``n`` new seeds derived deterministically from ``seed``."""
    _check_seed(seed)
    return tuple(emit("split_random_seed", torch.ops.ipuxl.modify_seed, (seed, i)) for i in range(n))


def create_seeds(seed: int, offset: int = 0, batches_per_step: int = 1, gradient_accumulation_factor: int = 1,
                 replicas: int = 1) -> np.ndarray:
    """Host seeds (uint32 pairs) for a seed stream, shaped like PopXL's (size-1 dims dropped)."""
    rng = np.random.default_rng(seed + offset)
    words = rng.integers(0, 2**32, size=(batches_per_step, gradient_accumulation_factor, replicas, 2),
                         dtype=np.uint64).astype(np.uint32)
    return np.squeeze(words, axis=tuple(i for i, d in enumerate(words.shape[:-1]) if d == 1))
