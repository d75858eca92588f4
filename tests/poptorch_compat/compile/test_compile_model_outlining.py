"""Automatic outlining in the PopTorch front end: deep models of identical blocks.

The code size the IPU resource model charges must stay flat as the model gets deeper
when outlining is on (the default) and grow linearly when it is off, while training
gives eager PyTorch's weights and losses either way.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
from ipuxl.device.resources import estimate
from ipuxl.passes.outline import MIN_SAVINGS

WIDTH, BATCH, STEPS = 12, 4, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + 0.5 * torch.tanh(self.fc(x))


class Deep(nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x, y):
        out = self.head(self.blocks(x))
        return out, F.cross_entropy(out, y)


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS * BATCH, WIDTH, generator=g), torch.randint(0, 3, (STEPS * BATCH,), generator=g)


def _train(blocks: int, outline: bool):
    torch.manual_seed(blocks)
    net = Deep(blocks)
    eager = copy.deepcopy(net)
    model = ipuxl.trainingModel(net, ipuxl.Options().deviceIterations(STEPS).autoOutline(outline),
                                optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    x, y = _data()
    out, loss = model(x, y)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    eager_losses = []
    for i in range(STEPS):
        o, l = eager(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
        opt.zero_grad()
        l.backward()
        opt.step()
        eager_losses.append(l.detach())
    for got, expected in zip(net.parameters(), eager.parameters()):
        assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert_close(loss.reshape(-1)[-1], eager_losses[-1], rtol=1e-5, atol=1e-6)
    return model, estimate(model._session.ir)


@pytest.mark.parametrize("outline", [False, True], ids=["inlined", "outlined"])
def test_code_size_against_depth_and_training_equals_eager(outline):
    sizes = {blocks: _train(blocks, outline)[1] for blocks in (4, 12, 48)}
    ops = {n: e.code_ops for n, e in sizes.items()}
    if outline:
        assert ops[12] == ops[48], ops  # each block's forward, backward and update: once
        # at 4 blocks the 2-op weight updates repeat too few times to be worth a call (MIN_SAVINGS)
        assert 0 <= ops[4] - ops[48] <= MIN_SAVINGS, ops
        # from 12 blocks on, code bytes grow only by the call sites (a few hundred bytes each)
        per_call = sizes[12].spec.code_bytes_per_call_site
        extra_calls = sizes[48].outlined_call_sites - sizes[12].outlined_call_sites
        assert sizes[48].code_bytes - sizes[12].code_bytes == extra_calls * per_call
    else:
        per_block = (ops[12] - ops[4]) / 8
        assert per_block >= 5
        assert ops[48] - ops[12] == 36 * per_block  # linear in depth


def test_outlining_is_on_by_default_and_results_are_bitwise_the_same():
    on, _ = _train(6, True)
    off, _ = _train(6, False)
    assert ipuxl.Options().auto_outline is True
    for a, b in zip(on.model.parameters(), off.model.parameters()):
        assert torch.equal(a, b)
    outlined = [g for g in on._session.ir.graphs if "block" in g.name.lower()]
    assert outlined and not [g for g in off._session.ir.graphs if "block" in g.name.lower()]


def test_training_model_report_shows_the_shared_block_graphs():
    model, _ = _train(12, True)
    report = model.report()
    text = str(report)
    assert "Block_subgraph" in text and "main_graph" in text
    blocks = [g for g in report.graphs if "block" in g.name.lower()]
    assert blocks and all(g.compiled_as == "outlined" and len(g.call_sites) >= 2 for g in blocks)
    # the Block module is traced once; its graph and its grad graph are called once per block
    sites = {g.name.split("_subgraph")[0]: len(g.call_sites) for g in blocks}
    assert sites["Block"] == sites["Block_grad"] == 12, sites
    net = Deep(2)
    untrained = ipuxl.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ipuxl.errors.DetachedError, match="not been compiled"):
        untrained.report()
