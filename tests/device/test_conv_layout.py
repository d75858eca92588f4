"""Grouped convolutions run in the layout measured faster (``kernels.conv_layout``):
either layout gives eager's results (channels-last up to rounding), outputs are NCHW,
and a model with depthwise convolutions trains as eager."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import ipuxl
from ipuxl.kernels import conv_layout

aten = torch.ops.aten
ARGS = ([1, 1], [1, 1], [1, 1], False, [0, 0])  # stride, padding, dilation, transposed, output_padding


@pytest.fixture
def fresh_choices(monkeypatch):
    """An empty decision table for the test (decisions are per process)."""
    monkeypatch.setattr(conv_layout, "_choices", {})


def _depthwise(channels=6, size=5):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, channels, size, size), torch.randn(channels, 1, 3, 3), torch.randn(channels)
    out = aten.convolution.default(x, w, b, *ARGS, channels)
    return x, w, b, torch.randn_like(out)


@pytest.mark.parametrize("margin, channels_last", [(0.0, True), (float("inf"), False)])
def test_either_layout_gives_the_nchw_kernels_results(fresh_choices, monkeypatch, margin, channels_last):
    """MARGIN 0 forces channels-last, infinity forces NCHW; both match torch's NCHW kernels."""
    monkeypatch.setattr(conv_layout, "MARGIN", margin)
    x, w, b, g = _depthwise()
    got = conv_layout.convolution(x, w, b, *ARGS, 6)
    want = aten.convolution.default(x, w, b, *ARGS, 6)
    grads = conv_layout.convolution_backward(g, x, w, [6], *ARGS, 6, [True, True, True])
    want_grads = aten.convolution_backward.default(g, x, w, [6], *ARGS, 6, [True, True, True])
    exact = dict(rtol=0, atol=0) if not channels_last else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, **exact)
    assert got.is_contiguous()
    for a, e in zip(grads, want_grads):
        torch.testing.assert_close(a, e, **exact)
        assert a.is_contiguous()
    assert sorted(k[0] for k in conv_layout.choices()) == ["backward", "forward"]
    assert set(conv_layout.choices().values()) == {channels_last}


def test_ungrouped_convolutions_and_the_switch_are_left_alone(fresh_choices, monkeypatch):
    torch.manual_seed(1)
    x, w = torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3)
    torch.testing.assert_close(conv_layout.convolution(x, w, None, *ARGS, 1),
                               aten.convolution.default(x, w, None, *ARGS, 1), rtol=0, atol=0)
    monkeypatch.setenv("IPUXL_CONV_LAYOUT", "nchw")
    x, w, b, _ = _depthwise()
    conv_layout.convolution(x, w, b, *ARGS, 6)
    assert conv_layout.choices() == {}


class DepthwiseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.ReLU6(),
                                  nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU6(),
                                  nn.Conv2d(8, 16, 3, padding=1, groups=4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(16, 4))

    def forward(self, x, y):
        out = self.body(x)
        return out, nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("margin", [0.0, conv_layout.MARGIN])
def test_a_model_with_grouped_convolutions_trains_as_eager(fresh_choices, monkeypatch, margin):
    monkeypatch.setattr(conv_layout, "MARGIN", margin)
    torch.manual_seed(2)
    model = DepthwiseNet()
    ref = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(2),
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 4, (8,))
    for _ in range(3):
        training(x, y)
        for xs, ys in zip(x.split(4), y.split(4)):
            ref_opt.zero_grad()
            ref(xs, ys)[1].backward()
            ref_opt.step()
    training.copyWeightsToHost()
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert any(k[0] == "backward" for k in conv_layout.choices())  # the grouped convolutions went through
