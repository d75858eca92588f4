"""``ipuxl.kernels.fused_attention``: CUDA's memory-efficient attention standing in for the
CPU trace's fused attention. On a GPU the real kernels are checked against the CPU
kernels (the oracle). Without one, the glue around them (mask conversion and alignment,
the log-sum-exp's padded query axis, layouts, refusals) is checked on the CPU with a
stand-in for the kernels that demands what the real ones demand, and the real kernels'
meta functions check the shapes they are called with."""
from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from ipuxl.kernels import fused_attention
from ipuxl.kernels.attention import attention_backward, attention_forward

aten = torch.ops.aten
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float mask scaled_dot_product_attention makes of a boolean one (the CPU kernel's)."""
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -math.inf)


def _case(dtype, mask: str, length: int = 100, keys: int = 100, heads: int = 3, dim: int = 16,
          device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # (batch, heads, tokens, dim) views of (batch, tokens, heads, dim) tensors, as transformers makes them
    q, k, v = (torch.randn(2, n, heads, dim, generator=gen).to(dtype).transpose(1, 2).to(device)
               for n in (length, keys, keys))
    if mask == "padding":  # transformers' padding mask, broadcast over heads and queries
        keep = torch.ones(2, 1, 1, keys, dtype=torch.bool)
        keep[0, ..., keys - 7:] = False
        return q, k, v, _additive(keep, dtype).expand(2, 1, length, keys).to(device)
    if mask == "float":
        return q, k, v, torch.randn(2, 1, length, keys, generator=gen).to(dtype).to(device)
    if mask == "row_fully_masked":
        keep = torch.ones(2, 1, length, keys, dtype=torch.bool)
        keep[0, 0, 2] = False
        return q, k, v, _additive(keep, dtype).to(device)
    return q, k, v, None


def _layouts(tensors):
    return [(t.shape, t.stride()) for t in tensors]


def _oracle(q, k, v, mask, causal, grad_out):
    """The CPU kernels the trace records, on CPU copies."""
    cpu = [t.cpu() if t is not None else None for t in (q, k, v, mask, grad_out)]
    out = aten._scaled_dot_product_flash_attention_for_cpu(*cpu[:3], 0.0, causal, attn_mask=cpu[3])
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(cpu[4], *cpu[:3], *out, 0.0, causal,
                                                                     attn_mask=cpu[3])
    return out, grads


# -- the glue, on the CPU, with a stand-in for the kernels ----------------------------------------

class _KernelStandIn:
    """What aten's memory-efficient kernels take and give, computed on the CPU: a 4-d
    additive bias in the query's dtype whose strides are multiples of 16, a log-sum-exp
    padded to 32 queries (padding filled with NaN so that reading it shows), the output in
    (batch, tokens, heads, dim) memory order."""

    def __init__(self):
        self.calls = {"forward": 0, "backward": 0}

    def _check_bias(self, bias, q):
        if bias is not None:
            assert bias.dim() == 4 and bias.dtype == q.dtype and bias.stride(-1) == 1
            assert all(s % 16 == 0 for s in bias.stride()[:-1]), bias.stride()

    def forward(self, q, k, v, bias, compute_lse, dropout_p, is_causal, *, scale=None):
        assert compute_lse and dropout_p == 0.0
        self._check_bias(bias, q)
        self.calls["forward"] += 1
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=bias,
                                                                    scale=scale)
        length = q.shape[-2]
        padded = torch.full((*lse.shape[:-1], -(-length // 32) * 32), math.nan)
        padded[..., :length] = lse
        return out.transpose(1, 2).contiguous().transpose(1, 2), padded, torch.empty(()), torch.empty(())

    def backward(self, grad_out, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal,
                 *, scale=None):
        assert dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False]
        assert lse.is_contiguous() and lse.shape[-1] % 32 == 0 and lse.dtype == torch.float32
        self._check_bias(bias, q)
        self.calls["backward"] += 1
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse[..., :q.shape[-2]], 0.0, is_causal, attn_mask=bias, scale=scale)
        return (*grads, None)


@pytest.fixture
def stand_in(monkeypatch):
    kernels = _KernelStandIn()
    monkeypatch.setattr(fused_attention, "_DEVICES", ("cpu",))
    monkeypatch.setattr(fused_attention, "_FORWARD", kernels.forward)
    monkeypatch.setattr(fused_attention, "_BACKWARD", kernels.backward)
    monkeypatch.setattr(fused_attention, "_REFUSED", set())
    return kernels


@pytest.mark.parametrize("mask, causal, keys", [("none", False, 100), ("none", True, 100), ("padding", False, 100),
                                                ("float", False, 100), ("float", False, 128),
                                                ("row_fully_masked", False, 100)])
def test_the_glue_gives_the_cpu_kernels_results_and_layouts(stand_in, mask, causal, keys):
    q, k, v, attn_mask = _case(torch.float32, mask, keys=keys)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    want, want_grads = _oracle(q, k, v, attn_mask, causal, grad_out)
    got = attention_forward(q, k, v, 0.0, causal, attn_mask, None, _layouts(want))
    got_grads = attention_backward(grad_out, q, k, v, *got, 0.0, causal, attn_mask, None, _layouts(want_grads))
    assert stand_in.calls == {"forward": 1, "backward": 1}
    for g, w in zip(got + got_grads, want + want_grads):
        assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
        assert_close(g, w, rtol=1e-5, atol=2e-6)


def test_a_boolean_mask_equals_its_additive_form(stand_in):
    q, k, v, additive = _case(torch.float32, "padding")
    got = attention_forward(q, k, v, attn_mask=additive == 0)
    want = attention_forward(q, k, v, attn_mask=additive)
    assert stand_in.calls["forward"] == 2
    for g, w in zip(got, want):
        assert_close(g, w, rtol=0, atol=0)


def test_a_fully_masked_row_has_log_sum_exp_zero_as_the_cpu_kernel(stand_in, monkeypatch):
    """The kernel leaves -inf there; the matrix-product backward (the fallback) needs 0."""
    q, k, v, attn_mask = _case(torch.float32, "row_fully_masked")

    def minus_inf_rows(*args, **kwargs):
        out, lse, seed, offset = _KernelStandIn.forward(stand_in, *args, **kwargs)
        return out, lse.masked_fill(lse == 0.0, -math.inf), seed, offset

    monkeypatch.setattr(fused_attention, "_FORWARD", minus_inf_rows)
    _, lse = attention_forward(q, k, v, attn_mask=attn_mask)
    assert lse[0, 0, 2].item() == 0.0 and torch.isfinite(lse).all()


def test_arguments_the_kernel_refuses_fall_back_to_matrix_products_and_are_remembered(stand_in, monkeypatch):
    def refuses(*args, **kwargs):
        stand_in.calls["forward"] += 1
        raise RuntimeError("head dimension not supported")

    monkeypatch.setattr(fused_attention, "_FORWARD", refuses)
    q, k, v, _ = _case(torch.float32, "none", length=9, keys=9)
    want = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    for _ in range(2):
        assert_close(attention_forward(q, k, v)[0], want[0])
    assert stand_in.calls["forward"] == 1  # refused once, then not asked again
    attention_backward(torch.ones_like(want[0]), q, k, v, *want)
    assert stand_in.calls["backward"] == 0  # the same kind of arguments: matrix products


@pytest.mark.parametrize("switch", ["environment", "torch.backends"])
def test_the_fused_path_can_be_switched_off(stand_in, monkeypatch, switch):
    if switch == "environment":
        monkeypatch.setenv("IPUXL_FUSED_ATTENTION", "0")
    else:
        monkeypatch.setattr(torch.backends.cuda, "mem_efficient_sdp_enabled", lambda: False)
    q, k, v, _ = _case(torch.float32, "none", length=9, keys=9)
    attention_forward(q, k, v)
    assert stand_in.calls["forward"] == 0 and not fused_attention.fused_attention_enabled()


def test_off_the_kernels_devices_nothing_is_asked_of_them():
    q, k, v, _ = _case(torch.float32, "none", length=9, keys=9)
    assert fused_attention.efficient_forward(q, k, v, False, None, None) is None


@pytest.mark.parametrize("keys", [100, 128])
def test_the_real_kernels_take_the_glues_arguments_on_meta_tensors(keys):
    """aten's meta functions for the CUDA kernels: the shapes the glue passes and reads."""
    q, k, v, mask = (t.to("meta") for t in _case(torch.float32, "padding", keys=keys))
    bias = fused_attention._bias(mask, q, k)
    out, lse, seed, offset = fused_attention._FORWARD(q, k, v, bias, True, 0.0, False)
    assert out.shape == q.shape and lse.shape == (2, 3, 128)
    grads = fused_attention._BACKWARD(out, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False],
                                      False)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]


# -- the real kernels, on a GPU ---------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask, causal", [("none", False), ("none", True), ("padding", False), ("float", False),
                                          ("row_fully_masked", False)])
def test_cuda_fused_attention_matches_the_cpu_kernels(monkeypatch, dtype, mask, causal):
    calls = []
    monkeypatch.setattr(fused_attention, "_FORWARD", lambda *a, **k: calls.append(1) or
                        torch.ops.aten._scaled_dot_product_efficient_attention.default(*a, **k))
    q, k, v, attn_mask = _case(dtype, mask, device="cuda")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype).cuda()
    want, want_grads = _oracle(q, k, v, attn_mask, causal, grad_out)
    got = attention_forward(q, k, v, 0.0, causal, attn_mask, None, _layouts(want))
    got_grads = attention_backward(grad_out, q, k, v, *got, 0.0, causal, attn_mask, None, _layouts(want_grads))
    assert calls, "the fused kernel was not used"
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for g, w in zip(got + got_grads, want + want_grads):
        assert (g.dtype, g.shape, g.stride(), g.device.type) == (w.dtype, w.shape, w.stride(), "cuda")
        assert_close(g.cpu(), w, **tol)


@needs_cuda
def test_cuda_fused_and_matrix_product_attention_agree():
    q, k, v, attn_mask = _case(torch.float32, "padding", device="cuda")
    fused = attention_forward(q, k, v, attn_mask=attn_mask)
    grads = attention_backward(torch.ones_like(fused[0]), q, k, v, *fused, attn_mask=attn_mask)
    assert not fused_attention._REFUSED
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("IPUXL_FUSED_ATTENTION", "0")
        plain = attention_forward(q, k, v, attn_mask=attn_mask)
        plain_grads = attention_backward(torch.ones_like(plain[0]), q, k, v, *plain, attn_mask=attn_mask)
    for g, w in zip(fused + grads, plain + plain_grads):
        assert_close(g, w, rtol=1e-4, atol=1e-4)
