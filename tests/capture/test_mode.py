"""``poptorch.identity_loss`` (``ipuxl.capture.mode``): its reductions train like eager PyTorch, and
its required ``reduction``; which output a training model's loss is (``find_loss``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import TraceError
from tests.capture._eager import train_like_eager
from tests.poptorch_compat.ops._harness import Wrap, assert_same_weights, train_both


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_identity_loss_reductions_train_like_eager(reduction):
    def forward(m, x, y):
        out = m.fc(x)
        per_sample = ((out - y) ** 2).sum(1)
        loss = per_sample.mean() if reduction == "none" else per_sample
        return out, poptorch.identity_loss(loss, reduction=reduction)

    torch.manual_seed(0)
    device, eager = train_both(Wrap(forward, fc=nn.Linear(3, 2)), (torch.randn(4, 3), torch.randn(4, 2)))
    assert_same_weights(device, eager)


def test_identity_loss_needs_one_of_the_three_reductions():
    """PopTorch 3.x: ``reduction`` is required; another value fails its assertion."""
    x = torch.ones(3)
    with pytest.raises(TypeError, match="reduction"):
        poptorch.identity_loss(x)  # type: ignore[call-arg]
    for error in (AssertionError, ValueError, poptorch.Error):
        with pytest.raises(error, match="reduction must be 'sum', 'mean' or 'none', got 'max'"):
            poptorch.identity_loss(x, "max")
    torch.testing.assert_close(poptorch.identity_loss(x * 2, "mean"), torch.tensor(2.0))


def _losses(kind):
    def forward(m, x, y):
        out = m.fc(x)
        loss = F.mse_loss(out, y)
        if kind == "same":  # one loss returned twice (Hugging Face's LUKE returns loss and mlm_loss)
            return loss, out, loss
        other = F.l1_loss(out, y)
        if kind == "marked":
            return poptorch.identity_loss(loss + 0.5 * other, reduction="none"), loss, other
        if kind == "scalars":  # no loss function: two float scalars
            return out.sum(), out.mean()
        return loss, other

    return forward


@pytest.mark.parametrize("kind", ["same", "marked"])
def test_one_loss_among_several_outputs_trains_as_eagerly(kind):
    """A loss returned twice is one loss; a marked loss is the loss, whatever other losses there are."""
    torch.manual_seed(0)
    train_like_eager(Wrap(_losses(kind), fc=nn.Linear(3, 2)), (torch.randn(4, 3), torch.randn(4, 2)),
                     lr=0.1, loss_of=lambda out: out[0])


@pytest.mark.parametrize("kind, message", [
    ("two", "Multiple independent losses found in graph"),  # PopTorch's error for two unrelated loss functions
    ("scalars", "returns 2 tensors that could each be the loss")])
def test_two_different_losses_are_ambiguous(kind, message):
    model = Wrap(_losses(kind), fc=nn.Linear(3, 2))
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TraceError, match=message) as caught:
        training(torch.randn(4, 3), torch.randn(4, 2))
    assert "identity_loss" in str(caught.value)
