"""``counter_random``'s draws and seed arithmetic on a GPU, one Triton kernel each.

``counter_random`` computes a draw off the CPU in int32 torch ops: the keys from the seed,
the hash, the compare and the scale of a dropout mask are 39 elementwise kernels on tiny or
mask-sized tensors, and the next seed (``modify_seed``) 13 more, for every dropout of a step.
Here each is one launch: ``_draw`` reads the two seed words, makes the keys and writes the
finished mask (or uniform or normal samples), and ``_seed_affine`` writes the next seed. The
integers are ``counter_random``'s exactly; the float arithmetic keeps its order and roundings
(``enable_fp_fusion=False``: no multiply-add contraction), so dropout masks and uniform draws
are bit for bit the CPU's, normal draws up to ``log``/``cos``/``sqrt`` rounding.

Used for CUDA seeds when Triton imports (it ships with torch's CUDA wheels) and a first
probe draw on the device compiles and runs (Triton builds its launcher with the host's C
compiler), unless ``IPUXL_TRITON=0``; anything else keeps ``counter_random``'s torch ops.
``interpreted()`` gives the same kernels under Triton's interpreter, which runs them on CPU
tensors: that is how ``tests/kernels/test_counter_random_triton.py`` checks them with no GPU.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from ipuxl.kernels.counter_random import int32_bits

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch's Linux wheels
    triton = None

__all__ = ["usable", "dropout_mask", "uniform", "normal", "seed_affine", "Kernels", "compiled", "interpreted"]

_BLOCK = 1024
_MODES = {"dropout": 0, "uniform": 1, "normal": 2}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_SEEDS = (torch.int32, torch.int64, torch.uint32)


if triton is not None:
    def _draw(seed_ptr, out_ptr, numel, least, scale, low, MODE: tl.constexpr, BLOCK: tl.constexpr):
        """Element i of the draw; MODE 0: ``(v >= least) * scale``; 1: ``v * 2**-24 * scale + low``;
        2: Box-Muller of draws i and i + numel, ``* scale + low``."""
        w0 = tl.load(seed_ptr).to(tl.uint32)
        w1 = tl.load(seed_ptr + 1).to(tl.uint32)
        # the keys: lowbias32 of each word (counter_random._mix_int)
        w0 = w0 ^ (w0 >> 16)
        w0 = w0 * 0x7FEB352D
        w0 = w0 ^ (w0 >> 15)
        w0 = w0 * 0x846CA68B
        m0 = w0 ^ (w0 >> 16)
        w1 = w1 ^ (w1 >> 16)
        w1 = w1 * 0x7FEB352D
        w1 = w1 ^ (w1 >> 15)
        w1 = w1 * 0x846CA68B
        m1 = w1 ^ (w1 >> 16)
        k1 = m0 + m1
        k2 = m0 ^ (m1 * 0x9E3779B9)
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = index < numel
        x = (index.to(tl.uint32) + k1) * 0x7FEB352D
        x = x ^ (x >> 16)
        x = (x ^ k2) * 0x846CA68B
        x = x ^ (x >> 15)
        x = x * 0x9E3779B1
        x = x ^ (x >> 16)
        v = (x >> 8) ^ 0x800000
        if MODE == 0:
            out = tl.where(v >= least.to(tl.uint32), scale, 0.0)
        elif MODE == 1:
            out = v.to(tl.float32) * 5.9604644775390625e-08 * scale + low
        else:
            y = (index.to(tl.uint32) + numel.to(tl.uint32) + k1) * 0x7FEB352D
            y = y ^ (y >> 16)
            y = (y ^ k2) * 0x846CA68B
            y = y ^ (y >> 15)
            y = y * 0x9E3779B1
            y = y ^ (y >> 16)
            first = v.to(tl.float32) * 5.9604644775390625e-08
            second = ((y >> 8) ^ 0x800000).to(tl.float32) * 5.9604644775390625e-08
            radius = tl.sqrt_rn(tl.log(1.0 - first) * -2.0)
            out = radius * tl.cos(second * 6.2831854820251465) * scale + low
        tl.store(out_ptr + index, out.to(out_ptr.dtype.element_ty), mask=inside)

    def _seed_affine(seed_ptr, out_ptr, multiplier, added, WITH_W0: tl.constexpr):
        """``[w0, w1 * multiplier + added (+ w0)]`` mod 2**32 (``modify_seed``, ``offset_seed``)."""
        w0 = tl.load(seed_ptr).to(tl.uint32)
        w1 = tl.load(seed_ptr + 1).to(tl.uint32) * multiplier.to(tl.uint32) + added.to(tl.uint32)
        if WITH_W0:
            w1 = w1 + w0
        element = out_ptr.dtype.element_ty
        tl.store(out_ptr, w0.to(element))
        tl.store(out_ptr + 1, w1.to(element))


class Kernels(NamedTuple):
    draw: Any
    seed_affine: Any


@lru_cache(maxsize=None)
def compiled() -> Kernels:
    assert triton is not None
    return Kernels(triton.jit(do_not_specialize=["numel", "least"])(_draw),
                   triton.jit(do_not_specialize=["multiplier", "added"])(_seed_affine))


def interpreted() -> Kernels:
    """The kernels under Triton's interpreter (CPU tensors; the tests)."""
    from triton.runtime.interpreter import InterpretedFunction
    return Kernels(InterpretedFunction(_draw), InterpretedFunction(_seed_affine))


@lru_cache(maxsize=None)
def _enabled() -> bool:
    return triton is not None and os.environ.get("IPUXL_TRITON", "1") != "0"


#: device index -> whether the probe draw compiled and ran there
_PROBED: dict[int, bool] = {}


def usable(seed: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether the kernels take this seed (and output dtype): a contiguous int32/int64/uint32 CUDA
    seed, on a device where the probe draw ran."""
    if not (seed.device.type == "cuda" and seed.dtype in _SEEDS and seed.is_contiguous()
            and (dtype is None or dtype in _FLOATS) and _enabled()):
        return False
    index = seed.device.index if seed.device.index is not None else torch.cuda.current_device()
    if index not in _PROBED:
        if torch.cuda.is_current_stream_capturing():
            return False  # no probe inside a CUDA graph capture: the tensor ops draw the same numbers
        _PROBED[index] = _probe(torch.device("cuda", index))
    return _PROBED[index]


def _probe(device: torch.device) -> bool:
    try:
        dropout_mask(torch.zeros(2, dtype=torch.int64, device=device), [1], 0.5, torch.float32)
    except Exception as error:  # a missing C compiler, an unsupported GPU: any failure means "not here"
        warnings.warn(f"ipuxl: Triton cannot build or run its kernels on {device} ({type(error).__name__}: "
                      f"{error}); the seeded draws use tensor ops there (IPUXL_TRITON=0 skips this probe)",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def _launch(kernels: Kernels, seed: torch.Tensor, shape: list[int], dtype: torch.dtype, mode: str,
            least: int, scale: float, low: float) -> torch.Tensor:
    numel = math.prod(shape)
    out = torch.empty(shape, dtype=dtype, device=seed.device)
    if numel:
        with _on(seed.device):
            kernels.draw[(triton.cdiv(numel, _BLOCK),)](seed, out, numel, least, scale, low, MODE=_MODES[mode],
                                                        BLOCK=_BLOCK, enable_fp_fusion=False)
    return out


def _on(device: torch.device) -> Any:
    """Triton launches on the current CUDA device: make it the seed's (a CPU tensor: the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def dropout_mask(seed: torch.Tensor, shape: list[int], p: float, dtype: torch.dtype,
                 kernels: Kernels | None = None) -> torch.Tensor:
    """``counter_random.dropout_mask`` for ``p < 1`` (``ceil(p * 2**24) < 2**24``)."""
    least = math.ceil(p * 2**24)
    scale = float(np.float32(1.0) / np.float32(1.0 - p))  # torch's div by the scalar, in float32
    return _launch(kernels or compiled(), seed, shape, dtype, "dropout", least, scale, 0.0)


def uniform(seed: torch.Tensor, shape: list[int], low: float, high: float, dtype: torch.dtype,
            kernels: Kernels | None = None) -> torch.Tensor:
    return _launch(kernels or compiled(), seed, shape, dtype, "uniform", 0, high - low, low)


def normal(seed: torch.Tensor, shape: list[int], mean: float, std: float, dtype: torch.dtype,
           kernels: Kernels | None = None) -> torch.Tensor:
    return _launch(kernels or compiled(), seed, shape, dtype, "normal", 0, std, mean)


def seed_affine(seed: torch.Tensor, multiplier: int, added: int, with_w0: bool,
                kernels: Kernels | None = None) -> torch.Tensor:
    """``[w0, (w1 * multiplier + added + (w0 if with_w0)) mod 2**32]`` in the seed's dtype."""
    out = torch.empty_like(seed)
    with _on(seed.device):
        (kernels or compiled()).seed_affine[(1,)](seed, out, int32_bits(multiplier), int32_bits(added), WITH_W0=with_w0)
    return out
