"""Shared by the tests of PopTorch's ops: a module around a function, and training it on the
device and eagerly side by side."""
from __future__ import annotations

import torch
import torch.nn as nn

from tests.poptorch_compat._checks import sgd_steps_like_eager


TOL = dict(rtol=1e-5, atol=1e-6)


def train_both(model: nn.Module, inputs: tuple, steps: int = 3, lr: float = 0.1) -> tuple[nn.Module, nn.Module]:
    """``steps`` SGD steps of ``model`` on the device and of a copy eagerly; returns (device, eager).
    Outputs of every step are compared."""
    training, ref = sgd_steps_like_eager(model, inputs, steps, lr, TOL)
    training.destroy()
    return model, ref


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m, n=name: f"{n}: {m}", **TOL)


class Wrap(nn.Module):
    """A module whose forward is ``fn(self, *inputs)``."""

    def __init__(self, fn, **children: nn.Module):
        super().__init__()
        self.fn = fn
        for name, child in children.items():
            self.add_module(name, child)

    def forward(self, *inputs):
        return self.fn(self, *inputs)
