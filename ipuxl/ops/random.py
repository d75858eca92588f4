"""Seeded random ops: ``dropout``, ``random_uniform``, ``random_normal``, seed splitting.

As in PopXL, randomness is a pure function of a seed tensor (two 32-bit words,
shape ``(2,)``), so a program is reproducible and the gradient of dropout reuses
the forward mask exactly. The random draws are torch custom ops (``ipuxl::*``) so that
they trace with make_fx as single nodes. Dropout multiplies by a seeded mask with
ordinary aten ops, so its gradient comes from PyTorch's autograd, which also works
under ``torch.func.vjp`` (what ``transforms.autodiff`` traces; custom ops with a
``register_autograd`` rule do not support functorch transforms).
"""
from __future__ import annotations

import numpy as np
import torch

from ipuxl.ir.build import emit
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor

__all__ = ["dropout", "random_uniform", "random_normal", "split_random_seed", "create_seeds"]


def _generator(seed: torch.Tensor) -> torch.Generator:
    hi, lo = (int(v) & 0xFFFFFFFF for v in seed.tolist())
    gen = torch.Generator(device=seed.device)
    gen.manual_seed((hi << 32 | lo) & 0x7FFFFFFFFFFFFFFF)
    return gen


# Plain implementations. The custom ops below call them (so that make_fx records one
# node per draw); the device calls them directly (``DIRECT_CALLS``), skipping the
# custom-op dispatch, which costs more than the draw itself for small tensors.
def random_uniform_impl(seed: torch.Tensor, shape: list[int], low: float, high: float,
                        dtype: torch.dtype) -> torch.Tensor:
    out = torch.rand(shape, generator=_generator(seed), device=seed.device)
    return (out * (high - low) + low).to(dtype)


def random_normal_impl(seed: torch.Tensor, shape: list[int], mean: float, std: float,
                       dtype: torch.dtype) -> torch.Tensor:
    out = torch.randn(shape, generator=_generator(seed), device=seed.device)
    return (out * std + mean).to(dtype)


def dropout_mask_impl(seed: torch.Tensor, shape: list[int], p: float, dtype: torch.dtype) -> torch.Tensor:
    keep = torch.rand(shape, generator=_generator(seed), device=seed.device) >= p
    return keep.to(dtype) / (1.0 - p)


_MIX_SEED, _MIX_MODIFIER = 0x9E3779B1, 0x85EBCA77
_STEP = (_MIX_MODIFIER * pow(_MIX_SEED, -1, 2**32)) & 0xFFFFFFFF  # see offset_seed_impl


def modify_seed_impl(seed: torch.Tensor, modifier: int) -> torch.Tensor:
    """A new seed from ``seed`` and ``modifier``: word 0 kept, word 1 mixed (mod 2**32)."""
    w0, w1 = (int(v) for v in seed.tolist())
    mixed = (w1 * _MIX_SEED + modifier * _MIX_MODIFIER + w0) & 0xFFFFFFFF
    return torch.tensor([w0, mixed], dtype=seed.dtype, device=seed.device)


def offset_seed_impl(seed: torch.Tensor, offset: int) -> torch.Tensor:
    """The seed ``s`` with ``modify_seed(s, j) == modify_seed(seed, offset + j)`` for every j.

    ``modify_seed`` is linear in its modifier mod 2**32 and its seed multiplier is odd
    (invertible), so adding ``offset * modifier / multiplier`` to word 1 shifts the
    modifier. An outlined block module uses it: its graph numbers its own dropouts
    1, 2... and gets the seed shifted by the dropouts that ran before the call, so
    its masks are those the inlined module would draw.
    """
    w0, w1 = (int(v) for v in seed.tolist())
    return torch.tensor([w0, (w1 + offset * _STEP) & 0xFFFFFFFF], dtype=seed.dtype, device=seed.device)


@torch.library.custom_op("ipuxl::random_uniform", mutates_args=())
def _random_uniform(seed: torch.Tensor, shape: list[int], low: float, high: float,
                    dtype: torch.dtype) -> torch.Tensor:
    return random_uniform_impl(seed, shape, low, high, dtype)


@_random_uniform.register_fake
def _(seed, shape, low, high, dtype):
    return torch.empty(shape, dtype=dtype, device=seed.device)


@torch.library.custom_op("ipuxl::random_normal", mutates_args=())
def _random_normal(seed: torch.Tensor, shape: list[int], mean: float, std: float,
                   dtype: torch.dtype) -> torch.Tensor:
    return random_normal_impl(seed, shape, mean, std, dtype)


@_random_normal.register_fake
def _(seed, shape, mean, std, dtype):
    return torch.empty(shape, dtype=dtype, device=seed.device)


@torch.library.custom_op("ipuxl::dropout_mask", mutates_args=())
def _dropout_mask(seed: torch.Tensor, shape: list[int], p: float, dtype: torch.dtype) -> torch.Tensor:
    return dropout_mask_impl(seed, shape, p, dtype)


@_dropout_mask.register_fake
def _(seed, shape, p, dtype):
    return torch.empty(shape, dtype=dtype, device=seed.device)


def _dropout(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """``x * keep / (1 - p)``; the mask depends on the seed only, so the gradient is ``dy * mask``."""
    if p == 0.0:
        return x.clone()
    return x * torch.ops.ipuxl.dropout_mask(seed, list(x.shape), p, x.dtype)


@torch.library.custom_op("ipuxl::modify_seed", mutates_args=())
def _modify_seed(seed: torch.Tensor, modifier: int) -> torch.Tensor:
    return modify_seed_impl(seed, modifier)


@_modify_seed.register_fake
def _(seed, modifier):
    return torch.empty_like(seed)


@torch.library.custom_op("ipuxl::offset_seed", mutates_args=())
def _offset_seed(seed: torch.Tensor, offset: int) -> torch.Tensor:
    return offset_seed_impl(seed, offset)


@_offset_seed.register_fake
def _(seed, offset):
    return torch.empty_like(seed)


_IMPLS = {"random_uniform": random_uniform_impl, "random_normal": random_normal_impl,
          "dropout_mask": dropout_mask_impl, "modify_seed": modify_seed_impl, "offset_seed": offset_seed_impl}
# fx nodes name an op by its packet (``torch.ops.ipuxl.x``) or overload (``.default``).
DIRECT_CALLS = {**{getattr(torch.ops.ipuxl, n): f for n, f in _IMPLS.items()},
                **{getattr(torch.ops.ipuxl, n).default: f for n, f in _IMPLS.items()}}


def _check_seed(seed: Tensor) -> None:
    if seed.shape != (2,) or seed.dtype.is_floating_point:
        raise InvalidArgumentError(
            f"seed tensor '{seed.name}' must have shape (2,) and an integer dtype, got "
            f"{seed.shape} {seed.dtype}", where=user_source_line(),
            fix="load a seed from ipuxl.create_seeds(...) through a uint32 h2d_stream of shape (2,)")


def dropout(t: Tensor, seed_tensor: Tensor, p: float) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)``."""
    _check_seed(seed_tensor)
    return emit("dropout", _dropout, (t, seed_tensor, float(p)))


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
