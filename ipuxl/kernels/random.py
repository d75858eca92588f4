"""Seeded random kernels and the ``torch.ops.ipuxl.*`` custom ops that wrap them.

Randomness is a pure function of a seed tensor (two 32-bit words, shape ``(2,)``).
The draws are torch custom ops (``ipuxl::random_uniform``, ``random_normal``,
``dropout_mask``, ``modify_seed``, ``offset_seed``) so that they trace with make_fx
as single nodes; importing this module registers them. Each custom op calls a plain
implementation (``*_impl``); the device calls those directly (``DIRECT_CALLS``),
skipping the custom-op dispatch, which costs more than the draw itself for small
tensors.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = [
    "random_uniform_impl", "random_normal_impl", "dropout_mask_impl", "modify_seed_impl", "offset_seed_impl",
    "dropout", "shaped_dropout", "DIRECT_CALLS",
]


def _generator(seed: torch.Tensor) -> torch.Generator:
    hi, lo = (int(v) & 0xFFFFFFFF for v in seed.tolist())
    gen = torch.Generator(device=seed.device)
    gen.manual_seed((hi << 32 | lo) & 0x7FFFFFFFFFFFFFFF)
    return gen


# -- the plain implementations ---------------------------------------------------------------
def random_uniform_impl(seed: torch.Tensor, shape: list[int], low: float, high: float,
                        dtype: torch.dtype) -> torch.Tensor:
    """Uniform samples in ``[low, high)`` drawn from ``seed``."""
    out = torch.rand(shape, generator=_generator(seed), device=seed.device)
    return (out * (high - low) + low).to(dtype)


def random_normal_impl(seed: torch.Tensor, shape: list[int], mean: float, std: float,
                       dtype: torch.dtype) -> torch.Tensor:
    """Normal samples with ``mean`` and ``std`` drawn from ``seed``."""
    out = torch.randn(shape, generator=_generator(seed), device=seed.device)
    return (out * std + mean).to(dtype)


def dropout_mask_impl(seed: torch.Tensor, shape: list[int], p: float, dtype: torch.dtype) -> torch.Tensor:
    """``keep / (1 - p)`` where each element is kept with probability ``1 - p``."""
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


# -- the custom ops ----------------------------------------------------------------------------
# Each has a fake (shape-only) implementation for tracing.
@torch.library.custom_op("ipuxl::random_uniform", mutates_args=())
def _random_uniform(seed: torch.Tensor, shape: list[int], low: float, high: float,
                    dtype: torch.dtype) -> torch.Tensor:
    return random_uniform_impl(seed, shape, low, high, dtype)


@_random_uniform.register_fake
def _(seed: torch.Tensor, shape: list[int], low: float, high: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=seed.device)


@torch.library.custom_op("ipuxl::random_normal", mutates_args=())
def _random_normal(seed: torch.Tensor, shape: list[int], mean: float, std: float,
                   dtype: torch.dtype) -> torch.Tensor:
    return random_normal_impl(seed, shape, mean, std, dtype)


@_random_normal.register_fake
def _(seed: torch.Tensor, shape: list[int], mean: float, std: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=seed.device)


@torch.library.custom_op("ipuxl::dropout_mask", mutates_args=())
def _dropout_mask(seed: torch.Tensor, shape: list[int], p: float, dtype: torch.dtype) -> torch.Tensor:
    return dropout_mask_impl(seed, shape, p, dtype)


@_dropout_mask.register_fake
def _(seed: torch.Tensor, shape: list[int], p: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=seed.device)


@torch.library.custom_op("ipuxl::modify_seed", mutates_args=())
def _modify_seed(seed: torch.Tensor, modifier: int) -> torch.Tensor:
    return modify_seed_impl(seed, modifier)


@_modify_seed.register_fake
def _(seed: torch.Tensor, modifier: int) -> torch.Tensor:
    return torch.empty_like(seed)


@torch.library.custom_op("ipuxl::offset_seed", mutates_args=())
def _offset_seed(seed: torch.Tensor, offset: int) -> torch.Tensor:
    return offset_seed_impl(seed, offset)


@_offset_seed.register_fake
def _(seed: torch.Tensor, offset: int) -> torch.Tensor:
    return torch.empty_like(seed)


def dropout(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """``x * keep / (1 - p)``; the mask depends on the seed only, so the gradient is ``dy * mask``.

    The mask is a custom op and the product an ordinary aten op, so the gradient comes
    from PyTorch's autograd, which also works under ``torch.func.vjp`` (custom ops with
    a ``register_autograd`` rule do not support functorch transforms).
    """
    if p == 0.0:
        return x.clone()
    return x * torch.ops.ipuxl.dropout_mask(seed, list(x.shape), p, x.dtype)


def shaped_dropout(x: torch.Tensor, seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    """``x * mask`` with a ``dropout_mask`` of ``shape`` broadcast over ``x`` (as ``dropout``)."""
    if p == 0.0:
        return x.clone()
    return x * torch.ops.ipuxl.dropout_mask(seed, shape, p, x.dtype)


_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "random_uniform": random_uniform_impl, "random_normal": random_normal_impl,
    "dropout_mask": dropout_mask_impl, "modify_seed": modify_seed_impl, "offset_seed": offset_seed_impl,
}

#: The plain implementation of each custom op, keyed by the targets fx nodes name it by:
#: its packet (``torch.ops.ipuxl.x``) or its overload (``.default``).
DIRECT_CALLS: dict[Any, Callable[..., torch.Tensor]] = {
    **{getattr(torch.ops.ipuxl, n): f for n, f in _IMPLS.items()},
    **{getattr(torch.ops.ipuxl, n).default: f for n, f in _IMPLS.items()},
}
