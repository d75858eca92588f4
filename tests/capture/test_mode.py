"""``poptorch.identity_loss`` (``ipuxl.capture.mode``): its reductions train like eager PyTorch, and
its required ``reduction``."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ipuxl.poptorch_compat as poptorch
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
