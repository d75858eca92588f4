"""In-place dropout, activations and Tensor methods inside a trained PopTorch model.

Eager torch is the oracle: outputs and losses every step and the weights after several
SGD steps match an eager copy; with p > 0, eager torch runs with the device's masks
(``DropoutReplay``), and the masks themselves have eager dropout's statistics.
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl
from ipuxl import Options
from ipuxl.errors import OpArgumentError, TraceError
from ipuxl.poptorch_compat import DropoutReplay
from tests.poptorch_compat._checks import raises_in, sgd_steps_like_eager

raises = raises_in(__file__)
TOL = dict(rtol=1e-5, atol=1e-6)
Layer = Callable[[torch.Tensor], torch.Tensor]


class Net(nn.Module):
    """``Linear -> reshape to shape -> layer (in place on the intermediate) -> Linear``, with a loss."""

    def __init__(self, layer: Layer, shape: tuple[int, ...] = (24,)):
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(6, 24)
        self.layer = layer
        self.head = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x).reshape(x.shape[0], *self.shape)
        out = self.head(self.layer(h).reshape(x.shape[0], -1))
        return out, F.cross_entropy(out, y)


def _data(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 6), torch.randint(0, 3, (batch,))


def _trains_as_eager(model: nn.Module, inputs: tuple, steps: int = 3, lr: float = 0.1) -> None:
    """Outputs, losses and (after ``steps`` SGD steps) weights match an eager copy."""
    start = copy.deepcopy(model)
    training, ref = sgd_steps_like_eager(model, inputs, steps, lr, TOL)
    training.copyWeightsToHost()
    for (name, p), q, s in zip(model.named_parameters(), ref.parameters(), start.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m, n=name: f"{n}: {m}", **TOL)
        assert not torch.equal(p.detach(), s.detach()), f"{name} was not trained"
    training.destroy()


# -- in-place dropout -----------------------------------------------------------------------------
# name -> (the dropout at probability p, applied in place; the shape it sees)
DROPOUTS: dict[str, tuple[Callable[[float], Layer], tuple[int, ...]]] = {
    "Dropout": (lambda p: nn.Dropout(p, inplace=True), (24,)),
    "Dropout1d": (lambda p: nn.Dropout1d(p, inplace=True), (4, 6)),
    "Dropout2d": (lambda p: nn.Dropout2d(p, inplace=True), (4, 2, 3)),
    "Dropout3d": (lambda p: nn.Dropout3d(p, inplace=True), (2, 2, 2, 3)),
    "AlphaDropout": (lambda p: nn.AlphaDropout(p, inplace=True), (24,)),  # eager ignores its inplace
    "FeatureAlphaDropout": (lambda p: nn.FeatureAlphaDropout(p, inplace=True), (4, 2, 3)),  # this one too
    "F.dropout": (lambda p: lambda h: F.dropout(h, p, True, inplace=True), (24,)),
    "F.alpha_dropout": (lambda p: lambda h: F.alpha_dropout(h, p, True, inplace=True), (24,)),
    "F.dropout2d_3d_input": (lambda p: lambda h: F.dropout2d(h, p, True, inplace=True), (4, 6)),
    "torch.dropout_": (lambda p: lambda h: torch.dropout_(h, p, True), (24,)),
}


@pytest.mark.parametrize("name", ["Dropout", "Dropout3d"])
def test_inplace_dropout_at_p0_trains_as_eager(name):
    make, shape = DROPOUTS[name]
    torch.manual_seed(0)
    _trains_as_eager(Net(make(0.0), shape), _data())


@pytest.mark.filterwarnings("ignore:dropout2d")
@pytest.mark.parametrize("name", list(DROPOUTS) + ["RReLU_training"])
def test_inplace_dropout_with_p_trains_as_eager_with_the_same_masks(name):
    """The device's masks, replayed in eager torch (whose in-place autograd is the oracle)."""
    make, shape = DROPOUTS.get(name, (lambda p: nn.RReLU(0.1, 0.4, inplace=True), (24,)))
    torch.manual_seed(1)
    model = Net(make(0.3), shape)
    ref = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, Options().randomSeed(7),
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    replay = DropoutReplay(7)
    for _ in range(3):
        x, y = _data()
        out, loss = training(x, y)
        ref_opt.zero_grad()
        with replay.step():
            ref_out, ref_loss = ref(x, y)
            ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(out, ref_out.detach(), **TOL)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    training.copyWeightsToHost()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m, n=n: f"{n}: {m}", **TOL)


class Sample(nn.Module):
    """Applies ``layer`` in place to ``x * w`` (``w`` ones, so the values are ``x``'s)."""

    def __init__(self, layer: Layer, features: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(features))
        self.layer = layer

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * self.w.reshape(-1, *[1] * (x.dim() - 2))
        out = self.layer(h)
        return out, ipuxl.identity_loss(out.sum(), "none")


@pytest.mark.filterwarnings("ignore:dropout2d")
@pytest.mark.parametrize("layer, shape, feature, alpha", [
    (lambda h: F.dropout(h, 0.3, True, inplace=True), (40, 500, 4), False, False),
    (nn.Dropout2d(0.3, inplace=True), (40, 500, 2, 2), True, False),
    (lambda h: F.dropout2d(h, 0.3, True, inplace=True), (40, 500, 4), True, False),  # 3-D: as dropout1d
    (lambda h: F.alpha_dropout(h, 0.3, True, inplace=True), (40, 500, 4), False, True),
    (lambda h: F.feature_alpha_dropout(h, 0.3, True, inplace=True), (40, 500, 2, 2), True, True),
])
def test_inplace_dropout_masks_have_eager_statistics(layer, shape, feature, alpha):
    """Eager's zeroed fraction, kept values scaled by 1 / (1 - p), one mask value per (sample,
    channel) for the feature dropouts; alpha dropout keeps eager's mean and standard deviation."""
    torch.manual_seed(2)
    x = torch.randn(shape)
    model = Sample(layer, shape[1])
    training = ipuxl.trainingModel(model, Options().randomSeed(3),
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    out, _ = training(x)
    eager = layer(x.clone())
    if alpha:
        torch.testing.assert_close(out.mean(), eager.mean(), rtol=0, atol=0.03)
        torch.testing.assert_close(out.std(), eager.std(), rtol=0.03, atol=0)
        return
    dropped = out == 0
    assert abs(dropped.float().mean().item() - (eager == 0).float().mean().item()) < 0.015
    torch.testing.assert_close(out[~dropped], x[~dropped] / 0.7)
    if feature:
        per_channel = dropped.flatten(2)
        assert torch.equal(per_channel.all(-1), per_channel.any(-1))
        assert not per_channel.all(-1).all(-1).any()  # channels, not whole samples


def test_inplace_dropout_rejects_a_probability_outside_0_1_as_eager():
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.dropout(torch.ones(2), 1.5, True, inplace=True)
    training = ipuxl.trainingModel(Net(lambda h: F.dropout(h, 1.5, True, inplace=True)))
    with raises(OpArgumentError, "dropout probability has to be between 0 and 1, but got 1.5"):
        training(*_data())


def test_dropout1d_rejects_a_4d_input_as_eager():
    with pytest.raises(RuntimeError, match="dropout1d"):
        F.dropout1d(torch.ones(2, 4, 2, 3), 0.5, True, inplace=True)
    training = ipuxl.trainingModel(Net(lambda h: F.dropout1d(h, 0.5, True, inplace=True), (4, 2, 3)))
    with raises(TraceError, "dropout1d", "4-D"):
        training(*_data())


# -- in-place activations -------------------------------------------------------------------------
ACTIVATIONS: dict[str, Callable[[], Layer]] = {
    "ReLU": lambda: nn.ReLU(inplace=True),
    "ReLU6": lambda: nn.ReLU6(inplace=True),
    "Hardswish": lambda: nn.Hardswish(inplace=True),
    "Hardsigmoid": lambda: nn.Hardsigmoid(inplace=True),
    "SiLU": lambda: nn.SiLU(inplace=True),
    "Mish": lambda: nn.Mish(inplace=True),
    "LeakyReLU": lambda: nn.LeakyReLU(0.1, inplace=True),
    "ELU": lambda: nn.ELU(0.7, inplace=True),
    "CELU": lambda: nn.CELU(0.5, inplace=True),
    "SELU": lambda: nn.SELU(inplace=True),
    "Hardtanh": lambda: nn.Hardtanh(-0.5, 0.5, inplace=True),
    "Threshold": lambda: nn.Threshold(0.1, -1.0, inplace=True),
    "RReLU_lower_eq_upper": lambda: nn.RReLU(0.2, 0.2, inplace=True),
    "RReLU_eval": lambda: nn.RReLU(0.1, 0.3, inplace=True).eval(),
    "F.relu6": lambda: lambda h: F.relu6(h, inplace=True),
    "F.selu": lambda: lambda h: F.selu(h, inplace=True),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_inplace_activation_after_linear_trains_as_eager(name):
    torch.manual_seed(3)
    _trains_as_eager(Net(ACTIVATIONS[name]()), _data())


class ConvNet(nn.Module):
    """``Conv2d -> BatchNorm2d -> activation in place -> pool -> Linear`` (MobileNet's blocks)."""

    def __init__(self, act: Layer):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.act = act
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.act(self.bn(self.conv(x))).mean((2, 3)))
        return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("name", ["Hardswish"])
def test_inplace_activation_after_conv_trains_as_eager(name):
    torch.manual_seed(4)
    _trains_as_eager(ConvNet(ACTIVATIONS[name]()), (torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))))


# -- in-place Tensor methods on intermediates and their views -------------------------------------
METHODS: dict[str, Layer] = {
    "relu_": lambda h: h.relu_(),
    "sigmoid_": lambda h: h.sigmoid_(),
    "mul_": lambda h: h.mul_(2),
    "add_tensor": lambda h: h.add_(h * 0.5, alpha=2),
    "clamp_": lambda h: h.clamp_(-0.3, 0.4),
    "chain": lambda h: h.mul_(3).sub_(0.1).div_(2).tanh_(),
    "view_slice": lambda h: (h[:, :10].relu_(), h)[1],
    "view_narrow": lambda h: ([h.narrow(1, 8 * i, 8).mul_(i + 1).add_(i) for i in range(3)], h.relu_())[1],
    "view_transpose": lambda h: (h.view(-1, 4, 6).transpose(1, 2)[:, 1].neg_(), h)[1],
    # composites that functionalize refuses: run as the in-place op they stand for
    "aliases": lambda h: h.clip_(-2, 2).multiply_(2.5).subtract_(0.5, alpha=2).divide_(3.0).negative_().arctan_(),
    "square_": lambda h: h.square_(),
    # copy_ into an intermediate: broadcast and cast source, another layout
    "copy_broadcast": lambda h: h.copy_(h[0].double() * 2),
    "copy_strides": lambda h: h.reshape(-1, 4, 6).copy_(h.reshape(-1, 6, 4).transpose(1, 2) * 2),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_inplace_tensor_method_on_an_intermediate_trains_as_eager(name):
    torch.manual_seed(5)
    _trains_as_eager(Net(METHODS[name]), _data())


def test_copy_into_a_channels_last_intermediate_trains_as_eager():
    def layer(h: torch.Tensor) -> torch.Tensor:
        h = h.reshape(-1, 4, 2, 3).contiguous(memory_format=torch.channels_last)
        return h.copy_(h.contiguous() * 3 + 1)

    torch.manual_seed(6)
    _trains_as_eager(Net(layer, (24,)), _data())


# -- a real model ---------------------------------------------------------------------------------
def test_mobilenet_v3_small_with_inplace_dropout_and_activations_trains_as_eager():
    torchvision = pytest.importorskip("torchvision")

    class WithLoss(nn.Module):
        def __init__(self, net: nn.Module):
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.net(x)
            return out, F.cross_entropy(out, y)

    torch.manual_seed(7)
    net = torchvision.models.mobilenet_v3_small(num_classes=10)
    dropouts = [m for m in net.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(m.inplace for m in dropouts)
    for m in dropouts:
        m.p = 0.0
    model = WithLoss(net)
    start = copy.deepcopy(model)
    inputs = (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
    training, ref = sgd_steps_like_eager(model, inputs, steps=2, lr=0.01, tol=dict(rtol=1e-4, atol=1e-5))
    training.copyWeightsToHost()
    for (name, p), q, s in zip(model.named_parameters(), ref.parameters(), start.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(model.net.classifier[3].weight, start.net.classifier[3].weight)
    training.destroy()
