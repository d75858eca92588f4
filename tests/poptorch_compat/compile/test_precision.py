"""``Options.Precision.halfFloatCasting``: ops mixing float16 and float32 operands."""
from __future__ import annotations

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.poptorch_compat.enums import HalfFloatCastingBehavior


class _Half(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3).half()

    def forward(self, x):
        return self.lin(x) * torch.tensor(2.0)  # a 0-d float32 factor does not promote


@pytest.mark.parametrize("casting", [None, HalfFloatCastingBehavior.HalfUpcastToFloat])
def test_a_float16_model_fed_float32_computes_in_float32(casting):
    model = _Half()
    x = torch.randn(2, 4)
    opts = poptorch.Options()
    if casting is not None:
        opts.Precision.halfFloatCasting(casting)
    out = poptorch.inferenceModel(model, opts)(x)
    with pytest.raises(RuntimeError):  # eager PyTorch refuses the mix
        model(x)
    expected = torch.nn.functional.linear(x, model.lin.weight.float(), model.lin.bias.float()) * 2
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)


def test_downcasting_computes_in_float16():
    model = _Half()
    x = torch.randn(2, 4)
    opts = poptorch.Options()
    opts.Precision.halfFloatCasting(HalfFloatCastingBehavior.FloatDowncastToHalf)
    out = poptorch.inferenceModel(model, opts)(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, model(x.half()), rtol=1e-3, atol=1e-3)


def test_a_float16_model_trains_on_float32_data():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).half()
    before = model.weight.detach().clone()
    loss_model = poptorch.trainingModel(
        _WithLoss(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    x = torch.randn(4, 3)
    loss_model(x)
    assert model.weight.dtype == torch.float16 and not torch.equal(model.weight.detach(), before)


class _WithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return out, poptorch.identity_loss(out.sum() ** 2, reduction="sum")
