"""popxl.addons' ``fp8_mse_scale``: the power-of-two scale for a float8 cast that loses the
least, by a mean-squared-error estimate from a histogram of the data's exponents.

As upstream's device op (``fp8_mse_scale_impl.cpp``), in float32 on the device:

1. A histogram of ``|src|`` over the levels ``2**-126 .. 2**127`` (cast to ``src``'s dtype:
   for float16 data the levels below ``2**-24`` become 0 and those above 65504 infinity,
   so float16 zeros count in the ``[2**-25, 2**-24)`` bin), normalised by the element count.
   ``h[c]`` is bin ``[2**(c-126), 2**(c-125))``, ``b[c] = 2**(c-126)``, ``c`` in 1..253.
2. For each candidate ``k`` in 0..61, the bins ``c < U = 85 + k`` (``float8_152``: 78 + k)
   underflow and cost ``h[c] * b[c]**2``; the ``span`` bins from ``U`` (18 for
   ``float8_143``, 33 for ``float8_152``) are in range and cost ``h[c] * b[c]**2 * q``
   (``q = 2**(-2 * (10 - mantissa bits))``: upstream compares a PopXL dtype with
   ``np.float32``, so the float16 figure holds for float32 data too); the rest overflow
   and cost ``h[c] * (b[U + span - 1] - b[c])**2``. Each term is rounded as the device's
   expression (``(h * b) * b * q``) and the costs are added bin by bin, in a repeat
   loop, as the device's loop adds them (so ties are the device's).
3. The scale is ``31 - (k0 + n // 2)``: ``k0`` the first candidate of least cost, ``n`` how
   many candidates share that cost (the middle of a run of ties), an int32 scalar in
   [-30, 31].

``popxl.fp8_utils.host_fp8_mse_scale`` (upstream's host version: float64, 63 candidates,
the overflow measured from another bin) agrees on ordinary data, such as upstream's test
data; as upstream's two, they can differ on float16 zeros, near-ties and the extreme scales.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ipuxl import ops
from ipuxl.addons_compat.ops.fp8_amax_scale import SCALE_RANGE, float8_format
from ipuxl.addons_compat.ops.fp8_utils import FpDef, ieee_fp16_denorms, ieee_fp32_no_denorms
from ipuxl.dtypes import DTypeLike, float8_143, float32
from ipuxl.ir import context
from ipuxl.ir.graph_builder import constant
from ipuxl.ir.tensor import Tensor

__all__ = ["fp8_mse_scale", "CandidateConfig", "mse_factors"]

#: the histogram's levels: every float32 binade, 2**-126 .. 2**127
LEVELS = [2.0 ** e for e in range(ieee_fp32_no_denorms.min_exp, ieee_fp32_no_denorms.max_exp + 1)]
#: how many candidate scales the device tries (upstream's ``Repeat(62, ...)``)
NUM_CANDIDATES = 62


class CandidateConfig:
    """The search's parameters for one float8 format, as upstream's ``CandidateConfig``."""

    def __init__(self, dest_ftype: FpDef, src_ftype: FpDef = ieee_fp32_no_denorms,
                 src_mantissa_bits: int = ieee_fp16_denorms.num_mantissa_bits):
        low, high = SCALE_RANGE
        self.num_exp_bits = dest_ftype.num_exp_bits
        self.num_mantissa_bits = dest_ftype.num_mantissa_bits
        self.fix_exponent_bias = dest_ftype.fix_exponent_bias
        #: the relative squared error of a value in range: 2**(-2 * (source - float8 mantissa bits))
        self.quantisation_error = 2 ** (-2.0 * (src_mantissa_bits - self.num_mantissa_bits))
        #: how many binades the format holds
        self.format_span = dest_ftype.max_exp - dest_ftype.min_exp + 1
        #: the first source binade (index from 2**-126) the format holds at the lowest scale
        self.min_src_exp = dest_ftype.min_exp + low - src_ftype.min_exp
        #: the last such binade at the highest scale
        self.max_src_exp = min(dest_ftype.min_exp + high - src_ftype.min_exp, src_ftype.max_exp - src_ftype.min_exp)
        self.num_exp_src = self.max_src_exp - self.min_src_exp + 1


@functools.lru_cache(maxsize=None)
def mse_factors(dest_ftype: FpDef) -> tuple[np.ndarray, np.ndarray]:
    """``(factor, weight)``, float32 ``(62, 254)``: candidate ``k``'s cost of bin ``c`` is
    ``((h[c] * factor[k, c]) * factor[k, c]) * weight[k, c]`` (bin 0, below ``2**-126``,
    costs nothing, as on the device)."""
    config = CandidateConfig(dest_ftype)
    bins = np.array(LEVELS, dtype=np.float32)
    factor = np.tile(bins, (NUM_CANDIDATES, 1))
    weight = np.ones_like(factor)
    factor[:, 0] = 0
    for k in range(NUM_CANDIDATES):
        first = config.min_src_exp + k
        beyond = first + config.format_span
        weight[k, first:beyond] = np.float32(config.quantisation_error)
        factor[k, beyond:] = bins[beyond - 1] - bins[beyond:]  # float32, as the device subtracts
    factor.setflags(write=False)
    weight.setflags(write=False)
    return factor, weight


def _add_bin(mse: Tensor, index: Tensor, terms: Tensor) -> tuple[Tensor, Tensor]:
    """One step of the device's loop: ``mse + terms[index]`` (each ``(1, candidates)``), and the next index."""
    return mse + ops.dynamic_slice(terms, index, [0], [1], True), index + 1


def fp8_mse_scale(src: Tensor, dtype: DTypeLike = float8_143) -> Tensor:
    """The log2 scale (an int32 scalar) for casting ``src`` to the float8 ``dtype`` that
    minimises the estimated mean squared error of the cast (see the module's description).

    Raises:
        UnsupportedError: (a RuntimeError, as upstream) ``src`` is not float16/float32, or
            ``dtype`` is not ``float8_143``/``float8_152``.
    """
    dest = float8_format("fp8_mse_scale", src, dtype)
    flat = src.flatten()
    counts = ops.histogram(flat, LEVELS, absolute_of_input=True)
    hist = (ops.cast(counts, torch.float32) / float(flat.nelms))[1:]
    factor, weight = (constant(a, float32) for a in mse_factors(dest))
    terms = ops.mul(ops.mul(hist * factor, factor), weight).transpose()  # (bin, candidate)
    # the device adds bin by bin, from bin 1: the same float32 sums, in the same order
    start = (constant(np.zeros((1, NUM_CANDIDATES), np.float32)), constant(np.array([1], np.int32)))
    add_bin = context.gcg().ir.create_graph(_add_bin, *start, terms)
    mse = ops.repeat(add_bin, len(LEVELS) - 1, *start, terms)[0].reshape((NUM_CANDIDATES,))
    least = ops.equal(mse, ops.min(mse))
    first = ops.argmin(mse, 0)
    half_ties = ops.cast(ops.floor(ops.sum(ops.cast(least, torch.float32)) * 0.5), torch.int32)
    return SCALE_RANGE[1] - first - half_ties
