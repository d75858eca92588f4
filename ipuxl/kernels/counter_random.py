"""Counter-based random numbers: a seeded draw is a pure function of the seed's two words and
each element's index, in integer arithmetic.

So the seeded draws of a program (``dropout_mask``, ``random_uniform``, ``random_normal``)
and its seed arithmetic (``modify_seed``, ``offset_seed``) need not read the seed on the
host (a CUDA graph can replay them, the seed variable advancing on the device), and a draw
is the same on every device: a program run on CUDA drops the elements ``DropoutReplay``
drops on the CPU (dropout masks and uniform draws bit for bit; normal draws up to the
rounding of ``log``/``cos``, which devices differ in).

Element ``i`` of a draw from seed words ``(w0, w1)`` has the 32 bits ``hash(i)``:

    x = (i + k1) * M1;  x ^= x >> 16;  x = (x ^ k2) * M2;  x ^= x >> 15;  x *= M3;  x ^= x >> 16

(Wellons' ``lowbias32`` multiply/xor-shift rounds with the keys mixed in; 32-bit words,
wrapping, logical shifts), the keys ``k1 = m0 + m1`` and ``k2 = m0 ^ (m1 * GOLDEN)`` from
``(m0, m1) = lowbias32(w0, w1)``. The uniform draw is ``v * 2**-24`` in ``[0, 1)``, ``v``
the top 24 bits of ``x`` with the highest flipped (``(x >> 8) + 2**23`` for a signed ``x``).

Two paths compute it, exactly the same integers (``tests/kernels/test_counter_random.py``
checks both against a numpy ``uint32`` reference): a seed on the CPU has its keys made in
Python ints (its values are on the host already) and the hash in numpy ``uint32`` (a numpy
op costs a small draw less than a torch op; a large one is memory-bound either way); on
any other device everything is int32 torch ops on the seed's device (two's-complement
wrapping, as every torch backend does; ``>>`` made logical by masking), with no host read.
On CUDA, where Triton imports, a draw and a seed update are one kernel launch each instead of
those ops (``counter_random_triton``: the same integers; 52 kernels a dropout with its seed before).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = ["int32_bits", "bits", "uniform", "dropout_mask", "normal", "modify_seed", "offset_seed"]

_MASK32 = 0xFFFFFFFF
_MIX1, _MIX2, _MIX3 = 0x7FEB352D, 0x846CA68B, 0x9E3779B1  # odd multipliers (lowbias32's, golden ratio)
_GOLDEN = 0x9E3779B9
_MIX_SEED, _MIX_MODIFIER = 0x9E3779B1, 0x85EBCA77
_STEP = (_MIX_MODIFIER * pow(_MIX_SEED, -1, 2**32)) & _MASK32  # see offset_seed
_TOP24 = 2.0 ** -24


def int32_bits(value: int) -> int:
    """A 32-bit word as the int32 value with its bits (what a torch int32 tensor holds)."""
    value &= _MASK32
    return value - 2**32 if value >= 2**31 else value


def _shift_xor(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x ^= x >>> shift`` in place (logical shift of int32 words)."""
    return x.bitwise_xor_((x >> shift).bitwise_and_((1 << (32 - shift)) - 1))


def _mix_words(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of each int32 element, in place."""
    x = _shift_xor(x, 16).mul_(int32_bits(_MIX1))
    return _shift_xor(_shift_xor(x, 15).mul_(int32_bits(_MIX2)), 16)


def _mix_int(v: int) -> int:
    """lowbias32 of one word, in Python ints."""
    v ^= v >> 16
    v = (v * _MIX1) & _MASK32
    v ^= v >> 15
    v = (v * _MIX2) & _MASK32
    return v ^ (v >> 16)


def _keys(seed: torch.Tensor) -> tuple[int, int] | tuple[torch.Tensor, torch.Tensor]:
    """``(k1, k2)`` as int32 values: Python ints for a CPU seed, else 0-dim tensors on its device."""
    if seed.device.type == "cpu":
        w0, w1 = (int(v) & _MASK32 for v in seed.reshape(2).tolist())
        m0, m1 = _mix_int(w0), _mix_int(w1)
        return int32_bits(m0 + m1), int32_bits(m0 ^ (m1 * _GOLDEN))
    return _device_keys(seed)


def _device_keys(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_keys`` in tensor ops on the seed's device (no host read)."""
    wide = seed.reshape(2).to(torch.int64) & _MASK32
    m = _mix_words((wide - ((wide >> 31) << 32)).to(torch.int32))  # int32 with the same bits, exactly
    return m[0] + m[1], m[0] ^ (m[1] * int32_bits(_GOLDEN))


def bits(seed: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` random 32-bit words (int32) from ``seed`` (see the module docstring)."""
    k1, k2 = _keys(_checked(seed, numel))
    if seed.device.type == "cpu":
        return torch.from_numpy(_numpy_words(int(k1), int(k2), numel).view(np.int32))
    return _torch_words(k1, k2, numel, seed.device)


def _gpu(seed: torch.Tensor, dtype: torch.dtype | None = None) -> Any:
    """``counter_random_triton`` where its kernels take this seed (and output dtype), else None
    (imported on the first CUDA seed only)."""
    if seed.device.type != "cuda":
        return None
    from ipuxl.kernels import counter_random_triton
    return counter_random_triton if counter_random_triton.usable(seed, dtype) else None


def _checked(seed: torch.Tensor, numel: int) -> torch.Tensor:
    if numel >= 2**31:
        raise ValueError(f"a seeded draw of {numel} elements: at most 2**31 - 1 are supported")
    return seed


def _torch_words(k1: int | torch.Tensor, k2: int | torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    """The hash in int32 torch ops on ``device``."""
    x = torch.arange(numel, dtype=torch.int32, device=device).add_(k1).mul_(int32_bits(_MIX1))
    x = _shift_xor(x, 16).bitwise_xor_(k2).mul_(int32_bits(_MIX2))
    return _shift_xor(_shift_xor(x, 15).mul_(int32_bits(_MIX3)), 16)


_U32 = np.uint32


def _numpy_words(k1: int, k2: int, numel: int) -> np.ndarray:
    """The hash in numpy ``uint32`` (the CPU's path)."""
    x = np.arange(numel, dtype=_U32)
    x += _U32(k1 & _MASK32)
    x *= _U32(_MIX1)
    x ^= x >> _U32(16)
    x ^= _U32(k2 & _MASK32)
    x *= _U32(_MIX2)
    x ^= x >> _U32(15)
    x *= _U32(_MIX3)
    x ^= x >> _U32(16)
    return x


def _draws24(seed: torch.Tensor, numel: int) -> torch.Tensor:
    """``v`` of each element: int32 in ``[0, 2**24)`` on the seed's device."""
    k1, k2 = _keys(_checked(seed, numel))
    if seed.device.type == "cpu":
        words = _numpy_words(int(k1), int(k2), numel)
        return torch.from_numpy(((words >> _U32(8)) ^ _U32(1 << 23)).view(np.int32))
    return _torch_draws24(k1, k2, numel, seed.device)


def _torch_draws24(k1: int | torch.Tensor, k2: int | torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    return (_torch_words(k1, k2, numel, device) >> 8).add_(1 << 23)


def _unit(seed: torch.Tensor, numel: int) -> torch.Tensor:
    """``v * 2**-24`` in ``[0, 1)`` for each element, in float32 (exact: 24 bits)."""
    return _draws24(seed, numel).to(torch.float32).mul_(_TOP24)


def uniform(seed: torch.Tensor, shape: list[int], low: float, high: float, dtype: torch.dtype) -> torch.Tensor:
    """Uniform samples in ``[low, high)`` (float32 arithmetic, then ``dtype``)."""
    if gpu := _gpu(seed, dtype):
        return gpu.uniform(_checked(seed, math.prod(shape)), shape, low, high, dtype)
    unit = _unit(seed, math.prod(shape))
    return unit.mul_(high - low).add_(low).to(dtype).reshape(shape)


def dropout_mask(seed: torch.Tensor, shape: list[int], p: float, dtype: torch.dtype) -> torch.Tensor:
    """``keep / (1 - p)``: an element is kept where its uniform draw is ``>= p`` (probability
    ``1 - p``), compared exactly on the integers: ``v * 2**-24 >= p`` iff ``v >= ceil(p * 2**24)``."""
    numel, least = math.prod(shape), math.ceil(p * 2**24)
    if seed.device.type == "cpu" and dtype == torch.float32 and least < 2**24:
        # all in numpy (a small mask's time is its op count): v >= least iff (x ^ 2**31) >= least * 2**8
        k1, k2 = _keys(_checked(seed, numel))
        mask = ((_numpy_words(int(k1), int(k2), numel) ^ _U32(1 << 31)) >= _U32(least << 8)).astype(np.float32)
        mask /= np.float32(1.0 - p)
        return torch.from_numpy(mask).reshape(shape)
    if least < 2**24 and (gpu := _gpu(seed, dtype)):
        return gpu.dropout_mask(_checked(seed, numel), shape, p, dtype)
    keep = _draws24(seed, numel) >= least
    return keep.to(dtype).div_(1.0 - p).reshape(shape)


def normal(seed: torch.Tensor, shape: list[int], mean: float, std: float, dtype: torch.dtype) -> torch.Tensor:
    """Normal samples (Box-Muller on two uniform draws per element, float32)."""
    n = math.prod(shape)
    if gpu := _gpu(seed, dtype):
        return gpu.normal(_checked(seed, 2 * n), shape, mean, std, dtype)
    unit = _unit(seed, 2 * n)
    radius = unit[:n].neg_().add_(1.0).log_().mul_(-2.0).sqrt_()  # 1 - u in (0, 1]: log is finite
    angle = unit[n:].mul_(2.0 * math.pi)
    return radius.mul_(angle.cos_()).mul_(std).add_(mean).to(dtype).reshape(shape)


def modify_seed(seed: torch.Tensor, modifier: int) -> torch.Tensor:
    """A new seed from ``seed`` and ``modifier``: word 0 kept, word 1 becomes
    ``(w1 * MIX_SEED + modifier * MIX_MODIFIER + w0) mod 2**32``."""
    added = modifier * _MIX_MODIFIER & _MASK32
    if seed.device.type == "cpu":
        w0, w1 = (int(v) for v in seed.tolist())
        return torch.tensor([w0, (w1 * _MIX_SEED + added + w0) & _MASK32]).to(seed.dtype)  # int32: wraps
    if gpu := _gpu(seed):
        return gpu.seed_affine(seed, _MIX_SEED, added, with_w0=True)
    return _device_modify(seed, added)


def _device_modify(seed: torch.Tensor, added: int) -> torch.Tensor:
    """``modify_seed`` in tensor ops on the seed's device, ``added = modifier * MIX_MODIFIER``."""
    wide = seed.to(torch.int64) & _MASK32
    w0, w1 = wide[0], wide[1]
    # w1 * MIX_SEED mod 2**32 without leaving int64: split w1 in 16-bit halves
    product = ((((w1 >> 16) * _MIX_SEED) & 0xFFFF) << 16) + (w1 & 0xFFFF) * _MIX_SEED
    return torch.stack([w0, (product + w0 + added) & _MASK32]).to(seed.dtype)


def offset_seed(seed: torch.Tensor, offset: int) -> torch.Tensor:
    """The seed ``s`` with ``modify_seed(s, j) == modify_seed(seed, offset + j)`` for every j.

    ``modify_seed`` is linear in its modifier mod 2**32 and its seed multiplier is odd
    (invertible), so adding ``offset * modifier / multiplier`` to word 1 shifts the
    modifier. An outlined block module uses it: its graph numbers its own dropouts
    1, 2... and gets the seed shifted by the dropouts that ran before the call, so
    its masks are those the inlined module would draw.
    """
    added = offset * _STEP & _MASK32
    if seed.device.type == "cpu":
        w0, w1 = (int(v) for v in seed.tolist())
        return torch.tensor([w0, (w1 + added) & _MASK32]).to(seed.dtype)
    if gpu := _gpu(seed):
        return gpu.seed_affine(seed, 1, added, with_w0=False)
    return _device_offset(seed, added)


def _device_offset(seed: torch.Tensor, added: int) -> torch.Tensor:
    """``offset_seed`` in tensor ops on the seed's device, ``added = offset * STEP``."""
    wide = seed.to(torch.int64) & _MASK32
    return torch.stack([wide[0], (wide[1] + added) & _MASK32]).to(seed.dtype)
