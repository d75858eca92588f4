"""Shared by the rewrite tests: train a module through ``trainingModel`` and in eager PyTorch
on the same data with AdamW, and compare weights and the last loss."""
from __future__ import annotations

import copy

import torch

import ipuxl

ITERATIONS = 3


def session_code(session: ipuxl.Session) -> str:
    """The generated code of a session's main program and of each compiled graph."""
    compiled = [session.compiled_graph(g) for g in session.ir.graphs]
    return "\n".join([session.code] + [c.module.code for c in compiled if c is not None])


def train_like_eager(model: torch.nn.Module, *inputs: torch.Tensor, calls: int = 2, lr: float = 1e-2,
                     optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW) -> str:
    """``calls`` calls of ``ITERATIONS`` steps each (``inputs`` hold every call's rows, in
    order) through ``trainingModel`` and in eager PyTorch, both with ``optimizer`` (AdamW);
    asserts equal weights and last loss, and returns the session's code."""
    eager = copy.deepcopy(model)
    opt = optimizer(eager.parameters(), lr=lr)
    ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(ITERATIONS),
                              optimizer=optimizer(model.parameters(), lr=lr))
    rows = len(inputs[0]) // calls
    for call in range(calls):
        batch = [t[call * rows:(call + 1) * rows] for t in inputs]
        loss = ipu(*batch)
        for step in zip(*(t.chunk(ITERATIONS) for t in batch)):
            opt.zero_grad()
            ref = eager(*step)
            ref.backward()
            opt.step()
    ipu.copyWeightsToHost()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    return session_code(ipu.session)
