"""In-place writes that autograd does not record, captured with eager's semantics.

``v.detach().clamp_()``, ``v.data.mul_()`` and in-place ops under ``torch.no_grad()``
change the values of ``v`` (and of every tensor sharing its storage) while the
gradient flows to ``v`` as if the write had not happened: eager autograd never saw
it. ``torch.distributions.Gamma.rsample`` does this. Eager torch is the oracle for
outputs, gradients (through the trained weights) and weights after SGD steps.
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn

import ipuxl
from ipuxl import Options

Write = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _detach_clamp(m: nn.Module, v: torch.Tensor) -> torch.Tensor:
    v.detach().clamp_(min=0)
    return v


def _data_mul(m: nn.Module, v: torch.Tensor) -> torch.Tensor:
    v.data.mul_(2.0)
    return v


def _view_of_detached(m: nn.Module, v: torch.Tensor) -> torch.Tensor:
    v.detach()[:, :2].mul_(-0.5)
    return v


def _detached_view(m: nn.Module, v: torch.Tensor) -> torch.Tensor:
    v[:, 1:].detach().mul_(0.5)
    return v


def _no_grad_clamp(m: nn.Module, v: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        v.clamp_(-0.2, 0.2)
    return v


def _no_grad_setitem(m: nn.Module, v: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        v[0] = 3.0
    return v


def _no_grad_view(m: nn.Module, v: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        v[:, 0].clamp_(-0.1, 0.1)
    return v


def _chained_views(m: nn.Module, v: torch.Tensor) -> torch.Tensor:
    v.detach()[1:].t()[0].mul_(-2.0)
    return v


def _returned_alias(m: nn.Module, v: torch.Tensor) -> torch.Tensor:
    out = v.detach().mul_(0.5)  # the detached alias itself, used later without gradient
    return v + out


WRITES = {f.__name__.lstrip("_"): f for f in (
    _detach_clamp, _data_mul, _view_of_detached, _detached_view, _no_grad_clamp, _no_grad_setitem, _no_grad_view,
    _chained_views, _returned_alias)}


class Net(nn.Module):
    """``fc2(write(fc1(x)) * v)`` with a loss: ``write`` changes ``fc1``'s output in place."""

    def __init__(self, write: Write):
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2)
        self.write = write

    def forward(self, x, y):
        h = self.write(self, self.fc1(x))
        out = self.fc2(h * h)  # reads h twice after the write
        return out, nn.functional.mse_loss(out, y)


def _data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)) for _ in range(3)]


def _train_as_eager(net: nn.Module, data: list[tuple[torch.Tensor, ...]], lr: float = 0.1,
                    trained: tuple[str, ...] | None = None) -> None:
    """Train ``net`` with ipuxl and a copy eagerly, one SGD step per batch; compare each
    step's outputs and the weights after every step."""
    ref = copy.deepcopy(net)
    model = ipuxl.trainingModel(net, Options(), optimizer=torch.optim.SGD(net.parameters(), lr=lr))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    start = copy.deepcopy(net)
    for x, y in data:
        out, loss = model(x, y)
        ref_opt.zero_grad()
        ref_out, ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(out, ref_out.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    for (name, p), s in zip(net.named_parameters(), start.parameters()):
        if trained is None or name in trained:
            assert not torch.equal(p, s), f"{name} was not trained"


@pytest.mark.parametrize("name", WRITES)
def test_unrecorded_writes_train_as_in_eager(name):
    torch.manual_seed(3)
    _train_as_eager(Net(WRITES[name]), _data(4))


def test_the_gradient_goes_straight_through_the_clamp():
    """The brief's example: ``w.grad`` is ``x`` in eager, though ``v``'s values are clamped."""
    class Clamped(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([1.0, -2.0, 3.0, -0.5]))

        def forward(self, x):
            v = self.w * x
            v.detach().clamp_(min=0)
            return v, v.sum()

    net = Clamped()
    x = torch.tensor([0.5, 1.5, -2.0, 4.0])
    w0 = net.w.detach().clone()
    model = ipuxl.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    v, loss = model(x)
    torch.testing.assert_close(v, (w0 * x).clamp(min=0))
    torch.testing.assert_close(loss, (w0 * x).clamp(min=0).sum())
    torch.testing.assert_close(net.w.detach(), w0 - x)  # SGD, lr 1: w - w.grad, and w.grad is x


def test_a_recorded_write_through_a_detached_alias_leaves_the_gradient_path_alone():
    """``d.add_(u)`` with ``u`` requiring grad is recorded on ``d``, not on ``v``: ``v``'s
    gradient still goes only to ``fc1``, and ``u`` gets none through ``v``."""
    class Added(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 3)
            self.u = nn.Parameter(torch.full((3,), 0.5))
            self.other = nn.Parameter(torch.ones(()))  # u gets no gradient: keep a second parameter training

        def forward(self, x, y):
            v = self.fc1(x)
            v.detach().add_(self.u)
            out = v * v * self.other
            return out, nn.functional.mse_loss(out.sum(1, keepdim=True).expand(-1, 2), y)

    torch.manual_seed(8)
    net = Added()
    u0 = net.u.detach().clone()
    _train_as_eager(net, _data(9), lr=0.01, trained=("fc1.weight", "fc1.bias", "other"))
    torch.testing.assert_close(net.u.detach(), u0, rtol=0, atol=0)


def test_parameter_written_through_data_in_forward_trains_as_in_eager():
    """Weight clipping inside forward: ``w.data.clamp_()`` then ``w`` used."""
    class Clipped(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x, y):
            self.fc.weight.data.clamp_(-0.3, 0.3)
            out = self.fc(x)
            return out, nn.functional.mse_loss(out, y)

    torch.manual_seed(5)
    _train_as_eager(Clipped(), _data(6), lr=0.5)


def test_signed_zeros_and_infinities_keep_their_values():
    class Signs(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([1.0, -1.0, 2.0, 0.5]))

        def forward(self, x):
            v = self.w * x
            v.detach().mul_(torch.tensor([-0.0, 0.0, 1.0, 1.0]))
            return v, (v * self.w).sum()

    x = torch.tensor([1.0, 1.0, float("inf"), 2.0])
    ref = Signs()
    ref_v, _ = ref(x)
    net = Signs()
    model = ipuxl.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0))
    v, _ = model(x)
    torch.testing.assert_close(v, ref_v.detach(), equal_nan=True)
    assert torch.equal(torch.signbit(v), torch.signbit(ref_v))


def test_inference_model_sees_the_written_values():
    torch.manual_seed(2)
    net = Net(WRITES["view_of_detached"])
    x, y = _data(1)[0]
    ref_out, ref_loss = copy.deepcopy(net)(x, y)
    out, loss = ipuxl.inferenceModel(net)(x, y)
    torch.testing.assert_close(out, ref_out.detach())
    torch.testing.assert_close(loss, ref_loss.detach())
