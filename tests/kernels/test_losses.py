"""``ipuxl.kernels.losses.log_softmax_nll_grad`` against aten's two gradient kernels (the oracle:
``nll_loss_backward`` then ``_log_softmax_backward_data``)."""
from __future__ import annotations

import pytest
import torch

from ipuxl.kernels.losses import log_softmax_nll_grad

aten = torch.ops.aten
REDUCTION = {"none": 0, "mean": 1, "sum": 2}


def _case(reduction: str, weighted: bool, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 11, generator=gen) * 3).to(dtype)
    log_probs = torch.log_softmax(logits, 1)
    target = torch.tensor([3, -100, 0, 10, 3, -100, 5])
    weight = torch.rand(11, generator=gen, dtype=dtype) + 0.5 if weighted else None
    loss, total = aten.nll_loss_forward(log_probs, target, weight, REDUCTION[reduction], -100)
    grad = torch.randn(loss.shape, generator=gen, dtype=dtype) if reduction == "none" else torch.tensor(0.7, dtype=dtype)
    return grad, log_probs, target, weight, REDUCTION[reduction], -100, total


def _aten_grad(grad, log_probs, target, weight, reduction, ignore_index, total):
    nll = aten.nll_loss_backward(grad, log_probs, target, weight, reduction, ignore_index, total)
    return aten._log_softmax_backward_data(nll, log_probs, 1, log_probs.dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_matches_aten_nll_then_log_softmax_gradient(reduction, weighted, in_place):
    grad, log_probs, target, weight, red, ignore, total = _case(reduction, weighted)
    want = _aten_grad(grad, log_probs, target, weight, red, ignore, total)
    before = log_probs.clone()
    got = log_softmax_nll_grad(log_probs, grad, target, weight, red, ignore, total, in_place)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert (got is log_probs) == in_place
    if not in_place:
        assert torch.equal(log_probs, before)  # the log-probabilities are left alone
    # ignored rows get exactly aten's +0 (not -0), target entries aten's value
    ignored = target == -100
    assert torch.equal(got[ignored], want[ignored]) and not torch.signbit(got[ignored]).any()


def test_float64_and_every_row_ignored():
    grad, log_probs, target, weight, red, ignore, total = _case("mean", False, torch.float64)
    want = _aten_grad(grad, log_probs, target, weight, red, ignore, total)
    torch.testing.assert_close(log_softmax_nll_grad(log_probs, grad, target, weight, red, ignore, total, False), want)
    target = torch.full_like(target, -100)  # total weight 0: aten writes nothing, the gradient is zero
    _, total = aten.nll_loss_forward(log_probs, target, None, red, ignore)
    got = log_softmax_nll_grad(log_probs, grad, target, None, red, ignore, total, False)
    assert torch.equal(got, torch.zeros_like(got)) and not torch.signbit(got).any()
