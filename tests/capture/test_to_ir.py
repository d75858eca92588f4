"""A module whose ``forward`` takes an argument named ``seed``: the captured program's
random-seed input is told apart by its role (``Role.SEED`` in placeholder meta), never
by its name, with and without dropout, for inference and training."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
from ipuxl import Options
from ipuxl.capture.to_ir import graph_from_trace
from ipuxl.capture.trace import trace_module
from ipuxl.ir.ir import Ir
from ipuxl.ir.meta import ROLE, Role
from ipuxl.poptorch_compat import DropoutReplay

RANDOM_SEED = 7


class SeedNet(nn.Module):
    """``seed`` is an ordinary data input here (e.g. a noise vector the user draws)."""

    def __init__(self, dropout: bool):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.drop = nn.Dropout(0.5) if dropout else nn.Identity()

    def forward(self, seed: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(seed))


class SeedNetWithLoss(SeedNet):
    def forward(self, seed: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().forward(seed)
        return out, F.mse_loss(out, target)


def _data(batch: int, call: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(call)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
def test_the_seed_placeholder_is_found_by_its_role(dropout):
    traced = trace_module(SeedNetWithLoss(dropout), _data(4, 0), training=True, need_loss=True)
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    # the user's seed and target, the two parameters, then the module's random seed
    assert [n.meta[ROLE] for n in placeholders] == [Role.INPUT] * 4 + [Role.SEED]
    assert traced.input_names == ["seed", "target"] and traced.uses_seed == dropout
    graph = graph_from_trace(Ir(), traced)
    names = ["seed", "target", "fc.weight", "fc.bias"] + (["seed"] if dropout else [])
    assert [t.name for t in graph.inputs] == names
    assert graph.inputs[0].shape == (4, 6)  # the user's input, not the (2,) random seed


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
def test_inference_with_an_input_named_seed_equals_eager(dropout):
    torch.manual_seed(0)
    net = SeedNet(dropout)
    opts = Options().deviceIterations(2).randomSeed(RANDOM_SEED)
    inference = ipuxl.inferenceModel(net, opts)
    x, _ = _data(2 * 4, 0)
    got = inference(x)
    assert_close(got, net.eval()(x))  # eval mode: dropout off, as the inference model
    assert_close(inference(seed=x), got)  # passed by keyword


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
def test_training_with_an_input_named_seed_equals_eager(dropout):
    torch.manual_seed(1)
    net = SeedNetWithLoss(dropout)
    ref = copy.deepcopy(net)
    opts = Options().deviceIterations(2).randomSeed(RANDOM_SEED)
    training = ipuxl.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    replay = DropoutReplay(RANDOM_SEED)  # the device's dropout masks, step by step (unused without dropout)
    for call in range(2):
        x, y = _data(2 * 4, call)
        _, loss = training(x, y)
        for xm, ym in zip(x.split(4), y.split(4)):
            ref_opt.zero_grad()
            with replay.step():
                _, ref_loss = ref(xm, ym)
            ref_loss.backward()
            ref_opt.step()
        assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)  # Final output mode: the last step's loss
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


class HeadNorm(nn.Module):
    """An RMS norm over each attention head, applied to a transposed tensor (Gemma 3's q_norm)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight)).type_as(x)


class HeadNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList([HeadNorm() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(2, 5, 3, 4).transpose(1, 2)  # (batch, heads, seq, dim) over (batch, seq, heads, dim) data
        for norm in self.norms:
            h = norm(h)
        return h.transpose(1, 2).reshape(2, 5, 12)  # a view only in the traced layout


def test_a_blocks_graph_takes_its_inputs_in_the_layout_it_was_traced_with():
    """An outlined block's inputs keep their traced strides (a transpose's here), so its
    callers' traced views stay valid; a module graph's own inputs are contiguous."""
    net = HeadNorms()
    x = torch.randn(2, 5, 12)
    traced = trace_module(net, (x,), training=False, need_loss=False, outline=True)
    assert len(traced.blocks) == 1
    ir = Ir()
    graph = graph_from_trace(ir, traced)
    block_input = traced.blocks[0].entry.graph.inputs[0].node.meta["val"]
    assert block_input.shape == (2, 3, 5, 4) and block_input.stride() == (60, 4, 12, 1)
    assert graph.inputs[0].node.meta["val"].stride() == (60, 12, 1)
    assert_close(ipuxl.inferenceModel(net)(x), net(x))
