"""A module held by several parents (timm's CoaT shares its positional encodings with its
blocks), and a tensor held by several modules (tied embeddings), through
``call_with_state`` and through capture: the values reach every path, and the module keeps
its own parameters afterwards, also when the call fails (``torch.func.functional_call``
with ``tie_weights=True`` left the first swapped-in value in a shared module's slot)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import ipuxl.poptorch_compat as poptorch
from ipuxl.capture.module_state import call_with_state
from ipuxl.errors import TraceError
from tests.capture._eager import train_like_eager


class _Block(nn.Module):
    def __init__(self, shared: nn.Module):
        super().__init__()
        self.shared = shared  # the parent's module: a second path to the same parameters
        self.own = nn.Linear(4, 4)

    def forward(self, x):
        return self.own(torch.tanh(self.shared(x)))


class SharedSubmodule(nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.encoding = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([_Block(self.encoding), _Block(self.encoding)])
        self.fail = fail

    def forward(self, x):
        for block in self.blocks:
            x = block(x) + self.encoding(x)
        if self.fail and x.sum() > 0:  # a decision on data: the capture stops here
            x = x * 2
        return x, x.pow(2).mean()


class TiedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        logits = self.head(torch.tanh(self.embed(ids)))
        return logits, logits.logsumexp(-1).mean()


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


@pytest.mark.parametrize("make", [SharedSubmodule, TiedEmbedding])
def test_the_values_reach_every_path_and_the_module_keeps_its_tensors(make):
    torch.manual_seed(0)
    model = make()
    before = _tensors(model)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(2)
    doubled = {name: p.detach() * 2 for name, p in model.named_parameters()}
    x = torch.randint(0, 10, (3,)) if make is TiedEmbedding else torch.randn(3, 4)
    torch.testing.assert_close(call_with_state(model, doubled, (x,), {})[0], reference(x)[0])
    after = _tensors(model)
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before))


def test_the_module_keeps_its_tensors_when_the_call_raises():
    model = SharedSubmodule()
    before = _tensors(model)

    def boom(module, args):
        raise ValueError("stop")

    model.blocks[1].register_forward_pre_hook(boom)
    with pytest.raises(ValueError, match="stop"):
        call_with_state(model, {name: p.detach() + 1 for name, p in model.named_parameters()},
                        (torch.randn(2, 4),), {})
    assert all(a is b for (_, a), (_, b) in zip(_tensors(model), before))


def test_a_shared_submodule_trains_as_eagerly_and_keeps_its_parameters():
    torch.manual_seed(0)
    model = SharedSubmodule()
    parameters = [p for _, p in _tensors(model)]
    train_like_eager(model, (torch.randn(3, 4),))
    assert all(a is b for a, (_, b) in zip(parameters, _tensors(model)))
    assert all(type(p) is nn.Parameter for p in parameters)


def test_a_failed_capture_leaves_a_shared_submodule_usable():
    """The capture's fake and functional tensors stayed in the shared slots: the module's
    weights were gone and its next eager call failed inside torch."""
    torch.manual_seed(0)
    model = SharedSubmodule(fail=True)
    state = {name: p.detach().clone() for name, p in model.state_dict().items()}
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TraceError, match="tensor values are not known"):
        ipu(torch.randn(3, 4))
    assert all(type(p) is nn.Parameter for _, p in _tensors(model))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name])
    model(torch.randn(3, 4))  # eager still runs


class RunningMean(nn.Module):
    """Keeps a running mean of its inputs by reassigning a buffer in ``forward`` (eager
    PyTorch replaces the buffer: ``self.mean`` holds the new value after each call)."""

    def __init__(self, shape=(4,)):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(shape))

    def forward(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        out = self.fc(x - self.mean)
        return out, out.square().mean()


def test_a_buffer_reassigned_in_forward_is_updated_as_eagerly():
    torch.manual_seed(0)
    model, x = RunningMean(), torch.randn(3, 4)
    eager = train_like_eager(model, (x,), buffers=True)  # weights and the buffer, step by step
    torch.testing.assert_close(model.mean, eager.mean)
    assert model.mean.abs().sum() > 0

    inference, reference = RunningMean(), RunningMean()
    reference.load_state_dict(inference.state_dict())
    ipu = poptorch.inferenceModel(inference)
    for step in range(3):
        torch.testing.assert_close(ipu(x + step)[0], reference(x + step)[0])
        torch.testing.assert_close(inference.mean, reference.mean)


def test_a_buffer_reassigned_with_another_shape_is_refused():
    class Grows(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(2))

        def forward(self, x):
            self.seen = torch.cat([self.seen, x])
            return x * 2

    with pytest.raises(TraceError, match=r"forward reassigns buffer 'seen' \(\(2,\) torch.float32\) with a value "
                                         r"of \(5,\) torch.float32") as info:
        poptorch.inferenceModel(Grows())(torch.ones(3))
    assert "copy_" in info.value.fix
