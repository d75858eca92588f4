"""``kernels.counter_random_triton``: the one-launch GPU kernels of the counter-based draws.

With no GPU they run under Triton's interpreter on CPU tensors and must give
``counter_random``'s numbers (the CPU's numpy path); Triton's compiler must also build them
for a GPU with no multiply-add contraction and logical shifts, which is what makes the
compiled kernels' floats and integers the interpreter's. On a GPU (``.ci/device_check.sh``)
the compiled kernels are checked against the CPU directly."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ipuxl.kernels import counter_random as cr

triton = pytest.importorskip("triton")
ct = pytest.importorskip("ipuxl.kernels.counter_random_triton")

SEEDS = [(0, 0), (1, 2), (2735729615, 3653403231), (0xFFFFFFFF, 0x7FFFFFFF), (0x80000000, 0xFFFFFFFF)]


@pytest.fixture(scope="module")
def kernels():
    return ct.interpreted()


def _seed(words, dtype=torch.int64, device="cpu"):
    values = [cr.int32_bits(w) for w in words] if dtype == torch.int32 else list(words)
    return torch.tensor(values, dtype=dtype, device=device)


@pytest.mark.parametrize("words", SEEDS)
@pytest.mark.parametrize("seed_dtype", [torch.int64, torch.int32, torch.uint32])
def test_dropout_masks_are_the_cpus(kernels, words, seed_dtype):
    seed = _seed(words, seed_dtype)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for p in (0.0, 0.1, 0.5, 0.97, 1 - 2**-24):
            for shape in ([37, 41], [3000], [1]):  # several blocks, a partial one, one element
                got = ct.dropout_mask(seed, shape, p, dtype, kernels=kernels)
                assert got.dtype == dtype and list(got.shape) == shape
                assert torch.equal(got, cr.dropout_mask(seed, shape, p, dtype)), (dtype, p, shape)


@pytest.mark.parametrize("words", SEEDS)
def test_uniform_draws_are_the_cpus(kernels, words):
    seed = _seed(words)
    for dtype in (torch.float32, torch.float16):
        got = ct.uniform(seed, [1500], -1.5, 3.25, dtype, kernels=kernels)
        assert torch.equal(got, cr.uniform(seed, [1500], -1.5, 3.25, dtype))
    # bfloat16: the interpreter rounds float32 -> bfloat16 toward zero where the compiled kernel
    # rounds to nearest (``test_the_compiled_kernels_keep_the_arithmetic``), so one bf16 ulp here
    got = ct.uniform(seed, [1500], -1.5, 3.25, torch.bfloat16, kernels=kernels)
    assert_close(got, cr.uniform(seed, [1500], -1.5, 3.25, torch.bfloat16), rtol=2**-7, atol=0)


@pytest.mark.parametrize("words", SEEDS)
def test_normal_draws_are_the_cpus_up_to_rounding(kernels, words):
    seed = _seed(words)
    got = ct.normal(seed, [40, 25], 0.5, 2.0, torch.float32, kernels=kernels)
    assert_close(got, cr.normal(seed, [40, 25], 0.5, 2.0, torch.float32))


@pytest.mark.parametrize("words", SEEDS)
@pytest.mark.parametrize("seed_dtype", [torch.int64, torch.int32, torch.uint32])
def test_seed_arithmetic_is_the_cpus(kernels, words, seed_dtype):
    seed = _seed(words, seed_dtype)
    for modifier in (0, 1, 7, 2**32 + 5):
        added = modifier * cr._MIX_MODIFIER & 0xFFFFFFFF
        got = ct.seed_affine(seed, cr._MIX_SEED, added, True, kernels=kernels)
        expected = cr._device_modify(seed, added)
        assert got.dtype == seed_dtype and torch.equal(got, expected)
        assert torch.equal(got, cr.modify_seed(seed, modifier))  # the CPU's Python-int path
    for offset in (1, 1000):
        added = offset * cr._STEP & 0xFFFFFFFF
        assert torch.equal(ct.seed_affine(seed, 1, added, False, kernels=kernels), cr._device_offset(seed, added))


def test_an_empty_draw_launches_nothing(kernels):
    assert ct.dropout_mask(_seed(SEEDS[1]), [0, 5], 0.5, torch.float32, kernels=kernels).shape == (0, 5)


def test_draws_launch_without_contraction_one_block_per_1024_elements():
    """The compiled kernel must be launched with ``enable_fp_fusion=False`` (the interpreter
    ignores the option, so it is checked on the launch itself)."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append((grid, args[2:6], options))

    ct.dropout_mask(_seed(SEEDS[1]), [3, 1000], 0.25, torch.float32, kernels=ct.Kernels(Recorder(), None))
    (grid, (numel, least, scale, low), options), = launches
    assert grid == (3,) and numel == 3000 and least == 2**22 and scale == pytest.approx(4 / 3) and low == 0.0
    assert options == {"MODE": 0, "BLOCK": 1024, "enable_fp_fusion": False}


def test_only_cuda_seeds_and_float_outputs_take_the_kernels(monkeypatch):
    cpu = _seed(SEEDS[1])
    assert not ct.usable(cpu) and not ct.usable(cpu, torch.float32)
    assert cr._gpu(cpu) is None  # the CPU keeps its numpy path (and never imports triton for it)
    monkeypatch.setenv("IPUXL_TRITON", "0")
    ct._enabled.cache_clear()
    try:
        assert not ct._enabled()
    finally:
        monkeypatch.delenv("IPUXL_TRITON")
        ct._enabled.cache_clear()
    assert ct._enabled()


def test_a_device_where_triton_cannot_run_falls_back_with_a_warning(kernels, monkeypatch):
    """The probe draw fails here for real (compiled kernels, no GPU driver): a RuntimeWarning that
    says what failed and the tensor ops draw instead; where it runs, the kernels are used."""
    with pytest.warns(RuntimeWarning, match="Triton cannot build or run its kernels on cpu.*tensor ops"):
        assert ct._probe(torch.device("cpu")) is False
    real = ct.dropout_mask
    monkeypatch.setattr(ct, "dropout_mask", lambda *args: real(*args, kernels=kernels))
    assert ct._probe(torch.device("cpu")) is True


def _ptx(fn, signature: dict[str, str], constexprs: dict[str, int]) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]


def test_the_compiled_kernels_keep_the_arithmetic():
    """Triton builds the kernels for an sm_90 GPU here, without one: the dropout and uniform
    kernels have no fused multiply-add (the CPU rounds the product, then the sum), shift the
    hash logically and round float32 -> bfloat16 to nearest."""
    draw = ct.compiled().draw
    for mode in (0, 1):
        for out, convert in (("*fp32", None), ("*bf16", "cvt.rn.bf16.f32")):
            ptx = _ptx(draw, {"seed_ptr": "*i64", "out_ptr": out, "numel": "i32", "least": "i32", "scale": "fp32",
                              "low": "fp32"}, {"MODE": mode, "BLOCK": 1024})
            assert "fma." not in ptx and "shr.u32" in ptx and "shr.s32" not in ptx, (mode, out)
            assert convert is None or convert in ptx
    ptx = _ptx(ct.compiled().seed_affine, {"seed_ptr": "*i32", "out_ptr": "*i32", "multiplier": "i32",
                                           "added": "i32"}, {"WITH_W0": True})
    assert "st.global" in ptx


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_draw_the_cpus_numbers(monkeypatch):
    calls = []
    monkeypatch.setattr(ct, "_launch", lambda *a, _real=ct._launch: calls.append(a[4]) or _real(*a))
    for words in SEEDS:
        for seed_dtype in (torch.int64, torch.int32, torch.uint32):
            cpu, gpu = _seed(words, seed_dtype), _seed(words, seed_dtype, "cuda")
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                assert torch.equal(cr.dropout_mask(gpu, [64, 65], 0.3, dtype).cpu(),
                                   cr.dropout_mask(cpu, [64, 65], 0.3, dtype))
                assert torch.equal(cr.uniform(gpu, [3000], -1.0, 2.0, dtype).cpu(),
                                   cr.uniform(cpu, [3000], -1.0, 2.0, dtype))
            assert_close(cr.normal(gpu, [3000], 0.0, 1.0, torch.float32).cpu(),
                         cr.normal(cpu, [3000], 0.0, 1.0, torch.float32))
            assert cr.modify_seed(gpu, 3).cpu().tolist() == cr.modify_seed(cpu, 3).tolist()
            assert cr.offset_seed(gpu, 9).cpu().tolist() == cr.offset_seed(cpu, 9).tolist()
    assert {"dropout", "uniform", "normal"} <= set(calls)
