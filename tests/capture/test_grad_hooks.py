"""Gradient hooks (``Tensor.register_hook``) train as eagerly: hooks a parameter carries (a
frozen embedding row), hooks a forward registers on activations (several, in order, on a
tensor read before and after), removed hooks; a hook on a tensor without gradient, one that
changes the gradient's shape and an optimiser-in-backward hook are refused."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import AutodiffError, TraceError
from tests.capture._eager import train_like_eager

STEPS = 3
FROZEN = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]).unsqueeze(1)  # embedding rows 1 and 4 stay


class Model(nn.Module):
    def __init__(self, forward_hooks: str = "none"):
        super().__init__()
        self.emb = nn.Embedding(6, 8)
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.forward_hooks = forward_hooks

    def forward(self, ids, y):
        h = self.lin(self.emb(ids)).tanh()
        early = h * 2  # read before the hooks are registered: its gradient goes through them too
        if self.forward_hooks in ("ordered", "removed"):
            h.register_hook(lambda g: g + 0.25)
            handle = h.register_hook(lambda g: g * 3)  # runs second: (g + 0.25) * 3
            if self.forward_hooks == "removed":
                handle.remove()
        out = self.head((early + h).mean(1))
        return out, F.cross_entropy(out, y)


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 6, (4, 5), generator=gen), torch.tensor([0, 2, 1, 1])


def _train_like_eager(model, optimizer=torch.optim.SGD, prepare=lambda model: None):
    train_like_eager(model, _batch(), steps=STEPS, lr=0.1, optimizer=optimizer, prepare=prepare)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_a_parameters_hook_masks_its_gradient_as_eagerly(optimizer):
    torch.manual_seed(0)
    model = Model()
    before = model.emb.weight.detach().clone()
    _train_like_eager(model, optimizer, prepare=lambda m: m.emb.weight.register_hook(lambda g: g * FROZEN))
    after = model.emb.weight.detach()
    if optimizer is torch.optim.SGD:  # (AdamW's weight decay moves every row)
        torch.testing.assert_close(after[[1, 4]], before[[1, 4]])  # the frozen rows did not move
    assert not torch.equal(after[0], before[0])


@pytest.mark.parametrize("forward_hooks", ["ordered", "removed"])
def test_hooks_registered_in_forward_run_in_order_as_eagerly(forward_hooks):
    torch.manual_seed(0)
    _train_like_eager(Model(forward_hooks))


def test_an_inference_model_ignores_the_hooks_as_eager_does():
    torch.manual_seed(0)
    model = Model("ordered").eval()
    out, loss = poptorch.inferenceModel(model)(*_batch())
    torch.testing.assert_close(out, model(*_batch())[0])


class _Hooks(nn.Module):
    def __init__(self, hook, on_input=False):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.hook, self.on_input = hook, on_input

    def forward(self, x):
        h = self.lin(x)
        (x if self.on_input else h).register_hook(self.hook)
        return h, h.sum()


def _step(model):
    return poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(torch.randn(2, 3))


def test_a_hook_on_a_tensor_without_gradient_raises_eagers_error():
    with pytest.raises(RuntimeError, match="cannot register a hook on a tensor that doesn't require gradient"):
        _Hooks(lambda g: g, on_input=True)(torch.randn(2, 3))
    with pytest.raises(TraceError, match="cannot register a hook on a tensor that doesn't require gradient"):
        _step(_Hooks(lambda g: g, on_input=True))


def test_a_hook_that_changes_the_gradients_shape_is_refused():
    with pytest.raises(AutodiffError, match="has changed the size or type of value") as info:
        _step(_Hooks(lambda g: g.sum(0)))
    assert "test_grad_hooks.py" in info.value.where


def test_an_optimiser_in_backward_hook_is_refused():
    model = _Hooks(lambda g: g)
    model.lin.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(TraceError, match="parameter 'lin.weight' has a post-accumulate-grad hook") as info:
        _step(model)
    assert "optimizer=" in info.value.fix


def test_a_modules_full_backward_hook_is_refused_with_the_tensor_hook_to_use():
    model = _Hooks(lambda g: g)
    model.lin.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    with pytest.raises(TraceError, match="BackwardHookFunction") as info:
        _step(model)
    assert "tensor.register_hook" in info.value.fix


def test_a_hook_registered_or_removed_between_calls_takes_effect_as_eagerly():
    """The program is compiled again when the parameters' hooks change."""
    torch.manual_seed(0)
    model = Model()
    eager = copy.deepcopy(model)
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    handles = []
    for step in range(4):
        if step == 1:  # frozen rows from the second step...
            handles = [m.emb.weight.register_hook(lambda g: g * FROZEN) for m in (model, eager)]
        if step == 3:  # ...to the third
            for handle in handles:
                handle.remove()
        _, loss = ipu(*_batch())
        eager_optimizer.zero_grad()
        eager(*_batch())[1].backward()
        eager_optimizer.step()
    ipu.copyWeightsToHost()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())
