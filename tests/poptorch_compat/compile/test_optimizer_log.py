"""The optimiser lines PopTorch's backend logs: when, and what they say."""
from __future__ import annotations

import logging
import re

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.poptorch_compat.compile.optimizer_log import optimizer_lines


class _Net(torch.nn.Module):
    def __init__(self, layers: int = 1):
        super().__init__()
        self.base = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, t):
        out = self.base(x)
        return out, self.loss(out, t)


_DATA = (torch.randn(2, 4), torch.tensor([1, 2]))


@pytest.fixture
def debug_lines(caplog):
    """The ``poptorch:cpp`` lines logged since the last call."""
    caplog.set_level(logging.DEBUG, logger="poptorch:cpp")

    def lines() -> list[str]:
        out = [r.getMessage() for r in caplog.records if r.name == "poptorch:cpp" and r.getMessage().startswith("Updating ")]
        caplog.clear()
        return out

    return lines


def _graph_line(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("Updating graph optimizer"))


@pytest.mark.parametrize("accum, first, second", [(torch.float16, torch.float32, torch.float16),
                                                  (torch.float32, torch.float16, torch.float32)])
def test_accumulator_types_are_logged(debug_lines, accum, first, second):
    net = _Net()
    opt = poptorch.optim.Adam(net.parameters(), lr=0.01, accum_type=accum, first_order_momentum_accum_type=first,
                              second_order_momentum_accum_type=second)
    poptorch.trainingModel(net, optimizer=opt)(*_DATA)
    name = {torch.float16: "float16", torch.float32: "float32"}
    assert (f"accumType={name[accum]}, firstOrderMomentumAccumType={name[first]}, "
            f"secondOrderMomentumAccumType={name[second]}") in _graph_line(debug_lines())


def test_lines_name_popart_attributes_in_order_with_their_constness(debug_lines):
    net = _Net(2)
    groups = [{"params": net.base[0].parameters()}, {"params": net.base[1].parameters(), "lr": 0.5}]
    opt = poptorch.optim.SGD(groups, lr=0.01, loss_scaling=2.0, use_combined_accum=False)
    poptorch.trainingModel(net, optimizer=opt)(*_DATA)
    lines = debug_lines()
    assert _graph_line(lines).startswith(
        "Updating graph optimizer with SGD2, defaultDampening=0 (const), defaultLearningRate=0.01, "
        "defaultMomentum=0 (const), defaultNesterov=0 (const), defaultVelocityScaling=2, "
        "defaultWeightDecay=0 (const), lossScaling=2,")
    assert lines[1].startswith("Updating group 0 optimizer with SGD2, dampening=0 (const), learningRate=0.01, ")
    assert lines[2].startswith("Updating group 1 optimizer with SGD2, dampening=0 (const), learningRate=0.5, ")
    assert lines[2].endswith("for (tensors affected [model.base.1.weight, model.base.1.bias])")


def test_torch_optimizers_have_constant_attributes_at_their_defaults(debug_lines):
    net = _Net()
    poptorch.trainingModel(net, optimizer=torch.optim.RMSprop(net.parameters(), lr=1.0))(*_DATA)
    line = _graph_line(debug_lines())
    for attribute in ("defaultAlpha", "defaultEps", "defaultMomentum", "defaultWeightDecay"):
        assert re.search(attribute + r"=[^ ,]+ \(const\)", line), attribute
    assert re.search(r"defaultLearningRate=1(?! \(const\))", line)


def test_set_optimizer_logs_only_an_optimizer_that_changed(debug_lines):
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = poptorch.trainingModel(net, optimizer=opt)
    model(*_DATA)
    assert len(debug_lines()) == 2
    model.setOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))  # the same values: nothing sent
    assert debug_lines() == []
    opt.param_groups[0]["lr"] = 0.05
    model.setOptimizer(opt)
    assert "learningRate=0.05," in debug_lines()[1]


def test_a_poptorch_optimizer_at_torchs_defaults_logs_the_same_lines_as_torchs():
    torch_net, pop_net = _Net(), _Net()
    names = {id(p): n for n, p in pop_net.named_parameters()}
    names.update({id(p): n for n, p in torch_net.named_parameters()})
    torch_lines = optimizer_lines(torch.optim.Adam(torch_net.parameters(), lr=1.0), names)
    pop_lines = optimizer_lines(poptorch.optim.Adam(pop_net.parameters(), lr=1.0), names)
    assert torch_lines == pop_lines
