"""Shared checks for the PopTorch-layer tests."""
from __future__ import annotations

import contextlib
import os
from typing import Callable, ContextManager, Iterator

import pytest

from ipuxl.errors import IpuxlError


def raises_in(test_file: str) -> Callable[..., ContextManager[pytest.ExceptionInfo]]:
    """``raises(error, *fragments)``: ``pytest.raises`` that also checks message fragments,
    that ``where`` names ``test_file`` (the user's line) and that a fix is given."""
    name = os.path.basename(test_file)

    @contextlib.contextmanager
    def raises(error: type[IpuxlError], *fragments: str) -> Iterator[pytest.ExceptionInfo]:
        with pytest.raises(error) as info:
            yield info
        message = str(info.value)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in:\n{message}"
        assert info.value.where and name in info.value.where
        assert info.value.fix

    return raises


def as_poptorch(expected):
    """An eager result as PopTorch returns it from the device: int64 comes back int32
    (the IPU has no 64-bit integers; upstream's own tests check this)."""
    import torch

    return expected.to(torch.int32) if expected.dtype == torch.int64 else expected


def sgd_steps_like_eager(model, inputs: tuple, steps: int, lr: float, tol: dict):
    """``steps`` SGD steps of ``model`` through ``trainingModel`` and of a deep copy eagerly;
    every step's outputs and loss must match eager's. Returns ``(training model, eager copy)``."""
    import copy

    import torch

    import ipuxl.poptorch_compat as poptorch

    ref = copy.deepcopy(model)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for _ in range(steps):
        out, loss = training(*inputs)
        ref_opt.zero_grad()
        ref_out, ref_loss = ref(*inputs)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(out, ref_out.detach(), **tol)
        torch.testing.assert_close(loss, ref_loss.detach(), **tol)
    return training, ref


def tanh_mlp():
    """A 6-8-3 MLP with tanh that returns ``(logits, cross-entropy loss)``."""
    import torch
    import torch.nn as nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(6, 8)
            self.fc2 = nn.Linear(8, 3)

        def forward(self, x, y):
            out = self.fc2(torch.tanh(self.fc1(x)))
            return out, nn.functional.cross_entropy(out, y)

    return MLP()


def eager_micro_steps(model, opt, x, y, micro: int) -> None:
    """One eager optimiser step per ``micro``-sample slice of ``(x, y)`` (a model returning ``(out, loss)``)."""
    for xs, ys in zip(x.split(micro), y.split(micro)):
        opt.zero_grad()
        model(xs, ys)[1].backward()
        opt.step()


def mlp_data(seed: int, samples: int):
    """``samples`` inputs for ``tanh_mlp`` and their class labels, from generator seed ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 6, generator=g), torch.randint(0, 3, (samples,), generator=g)
