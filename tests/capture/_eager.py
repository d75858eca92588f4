"""Shared by the capture tests: train a module through ``trainingModel`` and eagerly, step for
step on the same batch, and compare every step's loss and the weights afterwards."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

import ipuxl.poptorch_compat as poptorch


def train_like_eager(model: torch.nn.Module, batch: tuple | dict, *, steps: int = 3, lr: float = 0.05,
                     optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
                     loss_of: Callable[[Any], torch.Tensor] = lambda out: out[1],
                     oracle: Callable[[torch.nn.Module], torch.nn.Module] = copy.deepcopy,
                     prepare: Callable[[torch.nn.Module], Any] = lambda model: None,
                     buffers: bool = False) -> torch.nn.Module:
    """``steps`` steps of ``optimizer`` on ``batch`` (positional arguments, or keyword ones in a
    dict) through ``trainingModel`` and eagerly on ``oracle(model)`` (a deep copy); each step's
    loss (``loss_of`` the output) and then every parameter (``buffers``: the whole state dict)
    must be close. ``prepare`` runs on both models after the copy (a parameter's deep copy has no
    hooks). Returns the eager model."""
    eager = oracle(model)
    prepare(model)
    prepare(eager)
    ipu = poptorch.trainingModel(model, optimizer=optimizer(model.parameters(), lr=lr))
    eager_optimizer = optimizer(eager.parameters(), lr=lr)

    def call(module: Any) -> Any:
        return module(**batch) if isinstance(batch, dict) else module(*batch)

    for _ in range(steps):
        loss = loss_of(call(ipu))
        eager_optimizer.zero_grad()
        eager_loss = loss_of(call(eager))
        eager_loss.backward()
        eager_optimizer.step()
        torch.testing.assert_close(loss, eager_loss.detach())
    ipu.copyWeightsToHost()
    ours = model.state_dict() if buffers else dict(model.named_parameters())
    theirs = eager.state_dict() if buffers else dict(eager.named_parameters())
    for name, p in ours.items():
        torch.testing.assert_close(p.detach(), theirs[name].detach(), msg=lambda m, n=name: f"{n}: {m}")
    return eager
