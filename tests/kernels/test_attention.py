"""``ipuxl.kernels.attention`` against the CPU's fused attention kernels it stands in for on
other devices (the oracle: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward): values, log-sum-exp, gradients, dtypes and output layouts."""
from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from ipuxl.errors import UnsupportedError
from ipuxl.kernels.attention import attention_backward, attention_forward

aten = torch.ops.aten
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=2e-6),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float mask scaled_dot_product_attention makes of a boolean one (-inf where False)."""
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -math.inf)


def _case(dtype, mask: str, length: int = 7, keys: int = 7):
    gen = torch.Generator().manual_seed(0)
    # (batch, heads, tokens, 4) views of (batch, tokens, heads, 4) tensors, as transformers makes them
    q, k, v = (torch.randn(2, n, 3, 4, generator=gen).to(dtype).transpose(1, 2) for n in (length, keys, keys))
    if mask == "padding":
        keep = torch.ones(2, 1, length, keys, dtype=torch.bool)
        keep[0, ..., keys - 2:] = False
        return q, k, v, _additive(keep, dtype)
    if mask == "float":
        return q, k, v, torch.randn(2, 1, length, keys, generator=gen).to(dtype)
    if mask == "row_fully_masked":
        keep = torch.ones(2, 1, length, keys, dtype=torch.bool)
        keep[0, 0, 2] = False
        return q, k, v, _additive(keep, dtype)
    return q, k, v, None


def _layouts(tensors):
    return [(t.shape, t.stride()) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask, causal", [("none", False), ("none", True), ("padding", False), ("float", False),
                                          ("row_fully_masked", False)])
def test_attention_matches_the_cpu_kernels(dtype, mask, causal):
    q, k, v, attn_mask = _case(dtype, mask)
    want = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=attn_mask)
    got = attention_forward(q, k, v, 0.0, causal, attn_mask, None, _layouts(want))
    grad_out = torch.randn(want[0].shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want_grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, *want, 0.0, causal,
                                                                          attn_mask=attn_mask)
    got_grads = attention_backward(grad_out, q, k, v, *want, 0.0, causal, attn_mask, None, _layouts(want_grads))
    for g, w in zip(got + got_grads, want + want_grads):
        assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
        assert_close(g, w, **TOL[g.dtype if g.dtype in TOL else torch.float32])


def test_a_query_with_every_key_masked_gives_zeros_as_the_cpu_kernel():
    q, k, v, attn_mask = _case(torch.float32, "row_fully_masked")
    out, lse = attention_forward(q, k, v, attn_mask=attn_mask)
    assert torch.equal(out[0, 0, 2], torch.zeros(4)) and lse[0, 0, 2].item() == 0.0
    assert torch.isfinite(out).all()
    dq, dk, dv = attention_backward(torch.ones_like(out), q, k, v, out, lse, attn_mask=attn_mask)
    assert torch.equal(dq[0, 0, 2], torch.zeros(4)) and all(torch.isfinite(t).all() for t in (dq, dk, dv))


def test_a_boolean_mask_equals_its_additive_form():
    q, k, v, _ = _case(torch.float64, "none")
    keep = torch.rand(2, 1, 7, 7, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[..., 0] = True
    for got, want in zip(attention_forward(q, k, v, attn_mask=keep),
                         attention_forward(q, k, v, attn_mask=_additive(keep, torch.float64))):
        assert_close(got, want, rtol=0, atol=0)


def test_causal_attention_with_fewer_queries_than_keys_is_aligned_top_left():
    """``is_causal`` masks above the main diagonal of the (queries x keys) matrix, as
    ``scaled_dot_product_attention`` documents."""
    q, k, v, _ = _case(torch.float64, "none", length=3, keys=5)
    out, _ = attention_forward(q, k, v, is_causal=True)
    keep = torch.ones(3, 5, dtype=torch.bool).tril()
    assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_attention_dropout_is_refused_with_what_to_do():
    q, k, v, _ = _case(torch.float32, "none")
    with pytest.raises(UnsupportedError, match=r"attention dropout \(dropout_p=0.1\)") as info:
        attention_forward(q, k, v, 0.1)
    assert "set the model's attention dropout probability to 0" in str(info.value)
