"""A captured model's image inputs may run channels-last (``poptorch_compat.compile.memory_format``):
it trains as eager PyTorch does in that format, and the choice leaves the user's module,
RNG and tensors alone.

The oracle for a channels-last program is eager float32 with the module and its inputs
in channels-last format (the same kernels); eager NCHW float32 differs from both only by
rounding, checked with a looser tolerance.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import ipuxl
from ipuxl.poptorch_compat.compile import memory_format
from ipuxl.poptorch_compat.compile.batching import example_call, split_batch

CL = torch.channels_last
STEPS, BATCH = 2, 4


class DepthwiseNet(nn.Module):
    """A MobileNet-like block: pointwise, depthwise 3x3, batch norm, pooling, a classifier."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 1), nn.BatchNorm2d(16), nn.ReLU6(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.ReLU6(),
            nn.Conv2d(16, 8, 1))
        self.fc = nn.Linear(8, 5)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))
        return out, self.loss(out, y)


def _data(calls: int = 3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(STEPS * BATCH, 3, 12, 12, generator=g), torch.randint(0, 5, (STEPS * BATCH,), generator=g))
            for _ in range(calls)]


def _eager(model: nn.Module, data, channels_last: bool) -> nn.Module:
    model = copy.deepcopy(model)
    if channels_last:
        model = model.to(memory_format=CL)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in data:
        for xs, ys in zip(x.split(BATCH), y.split(BATCH)):
            opt.zero_grad()
            model(xs.contiguous(memory_format=CL) if channels_last else xs, ys)[1].backward()
            opt.step()
    return model


def _ipuxl(model: nn.Module, data):
    model = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(STEPS).useIpuModel(True),  # a CPU device
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for x, y in data:
        training(x, y)
    training.copyWeightsToHost()
    return model, training


@pytest.mark.parametrize("setting, expected", [("1", True), ("0", False)])
def test_forced_format_trains_as_eager_in_that_format(monkeypatch, setting, expected):
    monkeypatch.setenv(memory_format.ENV, setting)
    torch.manual_seed(0)
    model, data = DepthwiseNet(), _data()
    inputs_before = [x.clone() for x, _ in data]
    trained, training = _ipuxl(model, data)
    assert training._channels_last is expected
    oracle = _eager(model, data, channels_last=expected)
    for (name, got), want in zip(trained.state_dict().items(), oracle.state_dict().values()):
        assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    nchw = _eager(model, data, channels_last=False)  # the other format: rounding only
    for got, want in zip(trained.state_dict().values(), nchw.state_dict().values()):
        assert_close(got, want, rtol=1e-3, atol=1e-4)
    for (x, _), before in zip(data, inputs_before):  # the caller's inputs are not converted in place
        assert x.is_contiguous() and torch.equal(x, before)


def _example(model: nn.Module):
    options = ipuxl.Options().deviceIterations(STEPS)
    x, y = _data(1)[0]
    return example_call(split_batch(options, True, (x, y), {}).micro)


class DenseNet(nn.Module):
    """A ResNet-18-like net: dense 3x3 convolutions only."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


class BottleneckNet(nn.Module):
    """A ResNet-50-like bottleneck: 1x1 down, 3x3, 1x1 up; most weights are pointwise."""

    def __init__(self, wide: int = 128, narrow: int = 16):
        super().__init__()
        self.stem = nn.Conv2d(3, wide, 1)
        self.block = nn.Sequential(nn.Conv2d(wide, narrow, 1), nn.ReLU(), nn.Conv2d(narrow, narrow, 3, padding=1),
                                   nn.ReLU(), nn.Conv2d(narrow, wide, 1))

    def forward(self, x):
        h = self.stem(x)
        return (h + self.block(h)).mean()


@pytest.mark.parametrize("make, share, expected", [
    (DepthwiseNet, 0.0, True),  # 3x3 depthwise (grouped) and pointwise only
    (DenseNet, 1.0, False),  # past its stem, dense 3x3 only (as ResNet-18: 0.985)
    (BottleneckNet, 16 * 16 * 9 / (128 * 16 * 2 + 16 * 16 * 9), True),  # the stem (3 channels) left out
], ids=["depthwise", "dense-3x3", "bottleneck"])
def test_the_rule_follows_the_dense_share_of_the_convolution_weights(monkeypatch, make, share, expected):
    monkeypatch.delenv(memory_format.ENV, raising=False)
    model = make()
    assert memory_format.dense_share(model) == pytest.approx(share)
    args = (torch.randn(BATCH, 3, 12, 12),)
    assert memory_format.choose(model, args, {}, True) is expected
    assert memory_format.choose(model, args, {}, False) is expected  # inference: the same rule


def test_the_choice_is_deterministic_and_never_timed(monkeypatch):
    """The same model and inputs give the same decision whatever the clock says, and no step runs."""
    import time

    monkeypatch.delenv(memory_format.ENV, raising=False)
    ticks = iter(range(10**6))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks) % 7) * 1e3)  # nonsense
    monkeypatch.setattr(time, "monotonic", lambda: float(next(ticks) % 5) * -1e3)
    for make, expected in [(DepthwiseNet, True), (DenseNet, False)]:
        model = make()
        calls = []
        model.register_forward_pre_hook(lambda *a: calls.append(1))
        args = (torch.randn(BATCH, 3, 12, 12),)
        assert [memory_format.choose(model, args, {}, True) for _ in range(3)] == [expected] * 3
        assert not calls  # decided from the structure: the model never ran


def test_a_compiled_model_takes_the_rules_format_every_time(monkeypatch):
    monkeypatch.delenv(memory_format.ENV, raising=False)
    torch.manual_seed(0)
    model, data = DepthwiseNet(), _data(1)
    formats = []
    for _ in range(2):
        trained, training = _ipuxl(model, data)
        formats.append(training._channels_last)
    assert formats == [True, True]
    oracle = _eager(model, data, channels_last=True)
    for (name, got), want in zip(trained.state_dict().items(), oracle.state_dict().values()):
        assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_models_without_images_or_convolutions_stay_as_they_are(monkeypatch):
    monkeypatch.delenv(memory_format.ENV, raising=False)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * 12 * 12, 5))
    args, kwargs = _example(mlp)
    assert memory_format.dense_share(mlp) is None
    assert memory_format.choose(mlp, args, kwargs, True) is False  # a 4-D input, but no Conv2d
    stem = nn.Conv2d(3, 8, 3)
    assert memory_format.dense_share(stem) is None  # a stem only (ViT's, Swin's patch embedding)
    assert memory_format.choose(stem, (torch.zeros(4, 3, 8, 8),), {}, False) is False
    conv = nn.Conv2d(8, 8, 1)
    assert memory_format.choose(conv, (torch.zeros(4, 8),), {}, False) is False  # no 4-D input
    assert memory_format.choose(conv, (torch.zeros(4, 8, 2, 2),), {}, False) is True
    assert memory_format.choose(conv, (torch.zeros(4, 8, 2, 2, dtype=torch.float16),), {}, False) is False


def test_choosing_leaves_the_module_and_rng_alone(monkeypatch):
    monkeypatch.delenv(memory_format.ENV, raising=False)
    model = DepthwiseNet()
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    args, kwargs = _example(model)
    assert memory_format.choose(model, args, kwargs, True) is True
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():  # batch-norm statistics and weights untouched
        assert torch.equal(v, state[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_to_format_converts_only_float_images():
    x, y, flat = torch.randn(2, 3, 4, 4), torch.zeros(2, dtype=torch.long), torch.randn(2, 8)
    (cx, cy), kw = memory_format.to_format((x, y), {"extra": flat, "ints": torch.zeros(2, 3, 4, 4, dtype=torch.int32)},
                                            True)
    assert cx.is_contiguous(memory_format=CL) and torch.equal(cx, x)
    assert cy is y and kw["extra"] is flat and kw["ints"].is_contiguous()
    assert memory_format.to_format((x,), {}, False)[0][0] is x
