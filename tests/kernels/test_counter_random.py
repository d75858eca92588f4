"""``kernels.counter_random``: the seeded draws and seed arithmetic are exact integer functions of the
seed's values, checked against a numpy ``uint32`` reference (defined wrapping), so every device
draws the same numbers; on a GPU (``.ci/device_check.sh``) CUDA against the CPU directly."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from ipuxl.kernels import counter_random as cr

SEEDS = [(0, 0), (1, 2), (2735729615, 3653403231), (0xFFFFFFFF, 0x7FFFFFFF), (0x80000000, 0xFFFFFFFF)]


def _lowbias32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _reference_keys(w0: int, w1: int) -> tuple[np.uint32, np.uint32]:
    m0, m1 = _lowbias32(np.array([w0, w1], np.uint32))
    with np.errstate(over="ignore"):
        return m0 + m1, m0 ^ (m1 * np.uint32(0x9E3779B9))


def _reference_bits(w0: int, w1: int, n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        k1, k2 = _reference_keys(w0, w1)
        x = (np.arange(n, dtype=np.uint32) + k1) * np.uint32(0x7FEB352D)
        x = ((x ^ (x >> np.uint32(16))) ^ k2) * np.uint32(0x846CA68B)
        x = (x ^ (x >> np.uint32(15))) * np.uint32(0x9E3779B1)
        return x ^ (x >> np.uint32(16))


def _reference_unit(w0: int, w1: int, n: int) -> np.ndarray:
    """``v * 2**-24`` with ``v`` the top 24 bits, the highest flipped."""
    return ((_reference_bits(w0, w1, n) >> np.uint32(8)) ^ np.uint32(1 << 23)).astype(np.float64) * 2.0 ** -24


def _reference_modify(w0: int, w1: int, modifier: int) -> list[int]:
    return [w0, (w1 * 0x9E3779B1 + modifier * 0x85EBCA77 + w0) & 0xFFFFFFFF]


def _seed(words, device="cpu"):
    return torch.tensor(words, dtype=torch.int64, device=device)


@pytest.mark.parametrize("words", SEEDS)
def test_bits_are_the_reference_hash(words):
    got = cr.bits(_seed(words), 1000).numpy().view(np.uint32)
    np.testing.assert_array_equal(got, _reference_bits(*words, 1000))


@pytest.mark.parametrize("words", SEEDS)
def test_the_device_keys_are_the_hosts(words):
    """A seed off the CPU has its keys made by tensor ops (no host read): the same ints."""
    device_keys = [int(k) for k in cr._device_keys(_seed(words))]
    assert device_keys == [cr.int32_bits(int(k)) for k in _reference_keys(*words)] == list(cr._keys(_seed(words)))


@pytest.mark.parametrize("words", SEEDS)
def test_the_torch_path_draws_the_numpy_paths_words(words):
    """Off the CPU the hash runs in int32 torch ops, keys as 0-dim tensors: the same words."""
    n = 1000
    expected = torch.from_numpy(_reference_bits(*words, n).view(np.int32))
    assert torch.equal(cr.bits(_seed(words), n), expected)  # the CPU's numpy path
    assert torch.equal(cr._torch_words(*cr._device_keys(_seed(words)), n, torch.device("cpu")), expected)
    assert torch.equal(cr._torch_words(*cr._keys(_seed(words)), n, torch.device("cpu")), expected)


@pytest.mark.parametrize("words", SEEDS)
def test_the_torch_path_draws_the_numpy_paths_values(words):
    n = 1000
    expected = cr._draws24(_seed(words), n)
    assert expected.dtype == torch.int32 and 0 <= int(expected.min()) and int(expected.max()) < 2**24
    assert torch.equal(cr._torch_draws24(*cr._device_keys(_seed(words)), n, torch.device("cpu")), expected)
    np.testing.assert_array_equal(expected.numpy() * 2.0 ** -24, _reference_unit(*words, n))


@pytest.mark.parametrize("words", SEEDS)
@pytest.mark.parametrize("modifier", [0, 1, 7, 2**32 + 5])
def test_modify_seed_is_the_reference_mix(words, modifier):
    assert cr.modify_seed(_seed(words), modifier).tolist() == _reference_modify(*words, modifier)
    added = modifier * 0x85EBCA77 & 0xFFFFFFFF
    assert cr._device_modify(_seed(words), added).tolist() == _reference_modify(*words, modifier)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint32])
def test_seed_arithmetic_keeps_32_bit_seed_dtypes(dtype):
    """A 32-bit seed's new word wraps into its dtype (int32: the same bits, negative past 2**31)."""
    words = (0xFFFFFFF9, 5)
    seed = torch.tensor([cr.int32_bits(w) for w in words] if dtype == torch.int32 else words, dtype=dtype)
    for modifier in range(4):
        got = cr.modify_seed(seed, modifier)
        assert got.dtype == dtype and [v & 0xFFFFFFFF for v in got.tolist()] == _reference_modify(*words, modifier)
        assert torch.equal(got, cr._device_modify(seed, modifier * 0x85EBCA77 & 0xFFFFFFFF))
    assert torch.equal(cr.offset_seed(seed, 3), cr._device_offset(seed, 3 * cr._STEP & 0xFFFFFFFF))


@pytest.mark.parametrize("words", SEEDS)
def test_offset_seed_shifts_the_modifier(words):
    for offset in (1, 3, 1000):
        shifted = cr.offset_seed(_seed(words), offset)
        assert cr._device_offset(_seed(words), offset * cr._STEP & 0xFFFFFFFF).tolist() == shifted.tolist()
        for j in (0, 1, 5):
            assert cr.modify_seed(shifted, j).tolist() == _reference_modify(*words, offset + j)


def test_uniform_and_dropout_mask_are_the_top_24_bits():
    seed, shape = _seed(SEEDS[2]), [7, 9]
    top = _reference_unit(*SEEDS[2], 63)
    assert_close(cr.uniform(seed, shape, -1.0, 3.0, torch.float64), torch.from_numpy(top * 4.0 - 1.0).reshape(shape))
    for p in (0.0, 0.1, 0.5, 0.97, 1 - 2**-24):
        keep = torch.from_numpy(top >= p).reshape(shape)
        for dtype in (torch.float32, torch.float16):  # numpy's path, torch's
            mask = cr.dropout_mask(seed, shape, p, dtype)
            torch.testing.assert_close(mask, keep.to(dtype) / (1 - p), rtol=0, atol=0)
    assert cr.dropout_mask(seed, [3], 0.5, torch.float16).dtype == torch.float16


def test_normal_is_box_muller_of_two_uniform_draws():
    seed, n = _seed(SEEDS[1]), 50
    unit = _reference_unit(*SEEDS[1], 2 * n)
    expected = np.sqrt(-2 * np.log(1 - unit[:n])) * np.cos(2 * math.pi * unit[n:])
    assert_close(cr.normal(seed, [5, 10], 2.0, 0.5, torch.float32).double(),
                 torch.from_numpy(expected * 0.5 + 2.0).reshape(5, 10), rtol=1e-5, atol=1e-5)


def test_too_large_a_draw_is_refused():
    with pytest.raises(ValueError, match="2\\*\\*31"):
        cr.bits(_seed(SEEDS[0]), 2**31)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_the_cpus_numbers():
    for words in SEEDS:
        cpu, gpu = _seed(words), _seed(words, "cuda")
        assert torch.equal(cr.bits(gpu, 4096).cpu(), cr.bits(cpu, 4096))
        assert torch.equal(cr.dropout_mask(gpu, [64, 64], 0.3, torch.float32).cpu(),
                           cr.dropout_mask(cpu, [64, 64], 0.3, torch.float32))
        assert torch.equal(cr.uniform(gpu, [100], 0.0, 1.0, torch.float32).cpu(),
                           cr.uniform(cpu, [100], 0.0, 1.0, torch.float32))
        assert_close(cr.normal(gpu, [100], 0.0, 1.0, torch.float32).cpu(), cr.normal(cpu, [100], 0.0, 1.0,
                                                                                     torch.float32))
        assert cr.modify_seed(gpu, 3).tolist() == cr.modify_seed(cpu, 3).tolist()
