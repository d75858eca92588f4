"""Seeded random kernels and the ``torch.ops.ipuxl.*`` custom ops that wrap them.

Randomness is a pure function of a seed tensor (two 32-bit words, shape ``(2,)``).
The draws are torch custom ops, so that they trace with make_fx as single nodes;
importing this module registers them:

* PopXL's draws and the seed arithmetic (``ipuxl::random_uniform``, ``random_normal``,
  ``dropout_mask``, ``modify_seed``, ``offset_seed``) are counter-based
  (``counter_random``): the same numbers on every device; numpy on the CPU, tensor ops on
  the seed's device elsewhere (on CUDA one Triton kernel each, ``counter_random_triton``),
  with no host read (a CUDA graph replays them).
* Torch's random functions in captured modules (``random_fill``, ``random_integers``,
  ``random_permutation``, ``random_sample``) run torch's own samplers on a generator
  seeded from the seed tensor on the host, so each draws from exactly torch's
  distribution (and, like torch's, from a device's own generator: CPU and CUDA differ).

Each custom op calls a plain implementation (``*_impl``); the device calls those
directly (``DIRECT_CALLS``), skipping the custom-op dispatch, which costs more than the
draw itself for small tensors.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ipuxl.kernels import counter_random

__all__ = [
    "random_uniform_impl", "random_normal_impl", "dropout_mask_impl", "modify_seed_impl", "offset_seed_impl",
    "random_fill_impl", "random_integers_impl", "random_permutation_impl", "random_sample_impl", "FILL_KINDS",
    "SAMPLE_KINDS", "dropout", "shaped_dropout", "DIRECT_CALLS",
]


def _generator(seed: torch.Tensor) -> torch.Generator:
    hi, lo = (int(v) & 0xFFFFFFFF for v in seed.tolist())
    gen = torch.Generator(device=seed.device)
    gen.manual_seed((hi << 32 | lo) & 0x7FFFFFFFFFFFFFFF)
    return gen


# -- the plain implementations ---------------------------------------------------------------
# PopXL's draws and the seed arithmetic are counter-based (``counter_random``): the same numbers
# on every device, no host read off the CPU. Torch's samplers below draw from a generator seeded on the host.
random_uniform_impl = counter_random.uniform
random_normal_impl = counter_random.normal
dropout_mask_impl = counter_random.dropout_mask
modify_seed_impl = counter_random.modify_seed
offset_seed_impl = counter_random.offset_seed


#: the in-place samplers ``random_fill`` runs (``Tensor.<kind>_(*args)``)
FILL_KINDS = ("uniform", "normal", "exponential", "geometric", "cauchy", "log_normal", "bernoulli")


def random_fill_impl(seed: torch.Tensor, shape: list[int], dtype: torch.dtype, kind: str,
                     args: list[float]) -> torch.Tensor:
    """A ``shape`` tensor filled by torch's ``Tensor.<kind>_(*args)`` drawing from ``seed``."""
    out = torch.empty(shape, dtype=dtype, device=seed.device)
    return getattr(out, kind + "_")(*args, generator=_generator(seed))


def random_integers_impl(seed: torch.Tensor, shape: list[int], dtype: torch.dtype, low: int | None,
                         high: int | None) -> torch.Tensor:
    """Torch's ``Tensor.random_(low, high)`` (``random_()`` when ``low`` is None) drawing from ``seed``."""
    out = torch.empty(shape, dtype=dtype, device=seed.device)
    if low is None:
        return out.random_(generator=_generator(seed))
    return out.random_(low, high, generator=_generator(seed))


def random_permutation_impl(seed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Torch's ``randperm(n)`` drawing from ``seed``."""
    return torch.randperm(n, generator=_generator(seed), dtype=dtype, device=seed.device)


def _sample(kind: str, inputs: list[torch.Tensor], args: list[float], gen: torch.Generator | None) -> torch.Tensor:
    if kind == "multinomial":
        return torch.multinomial(inputs[0], int(args[0]), bool(args[1]), generator=gen)
    return SAMPLE_KINDS[kind](*inputs, generator=gen)


#: the samplers ``random_sample`` runs on its tensor inputs (multinomial takes ``args``)
SAMPLE_KINDS: dict[str, Callable[..., torch.Tensor]] = {
    "bernoulli": torch.bernoulli, "multinomial": torch.multinomial, "poisson": torch.poisson,
    "binomial": torch.binomial,
    # torch's private samplers behind torch.distributions' Gamma and Dirichlet (no public ones)
    "standard_gamma": torch._standard_gamma, "dirichlet": torch._sample_dirichlet,
}


def random_sample_impl(seed: torch.Tensor, kind: str, inputs: list[torch.Tensor], args: list[float]) -> torch.Tensor:
    """Torch's sampler ``kind`` on ``inputs`` (probabilities, rates...) drawing from ``seed``."""
    return _sample(kind, inputs, args, _generator(seed))


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


@torch.library.custom_op("ipuxl::random_fill", mutates_args=())
def _random_fill(seed: torch.Tensor, shape: list[int], dtype: torch.dtype, kind: str,
                 args: list[float]) -> torch.Tensor:
    return random_fill_impl(seed, shape, dtype, kind, args)


@_random_fill.register_fake
def _(seed: torch.Tensor, shape: list[int], dtype: torch.dtype, kind: str, args: list[float]) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=seed.device)


@torch.library.custom_op("ipuxl::random_integers", mutates_args=())
def _random_integers(seed: torch.Tensor, shape: list[int], dtype: torch.dtype, low: int | None,
                     high: int | None) -> torch.Tensor:
    return random_integers_impl(seed, shape, dtype, low, high)


@_random_integers.register_fake
def _(seed: torch.Tensor, shape: list[int], dtype: torch.dtype, low: int | None, high: int | None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=seed.device)


@torch.library.custom_op("ipuxl::random_permutation", mutates_args=())
def _random_permutation(seed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    return random_permutation_impl(seed, n, dtype)


@_random_permutation.register_fake
def _(seed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, device=seed.device)


@torch.library.custom_op("ipuxl::random_sample", mutates_args=())
def _random_sample(seed: torch.Tensor, kind: str, inputs: list[torch.Tensor], args: list[float]) -> torch.Tensor:
    return random_sample_impl(seed, kind, inputs, args)


@_random_sample.register_fake
def _(seed: torch.Tensor, kind: str, inputs: list[torch.Tensor], args: list[float]) -> torch.Tensor:
    return _sample(kind, inputs, args, None)  # torch's own shape rules, on fake inputs


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
    "random_fill": random_fill_impl, "random_integers": random_integers_impl,
    "random_permutation": random_permutation_impl, "random_sample": random_sample_impl,
}

#: The plain implementation of each custom op, keyed by the targets fx nodes name it by:
#: its packet (``torch.ops.ipuxl.x``) or its overload (``.default``).
DIRECT_CALLS: dict[Any, Callable[..., torch.Tensor]] = {
    **{getattr(torch.ops.ipuxl, n): f for n, f in _IMPLS.items()},
    **{getattr(torch.ops.ipuxl, n).default: f for n, f in _IMPLS.items()},
}
