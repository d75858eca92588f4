"""A model's own ``torch.autograd.Function``s train through ``trainingModel`` with their own
backward, as eagerly: old style (``forward(ctx, ...)``) and new style (``setup_context``), saved
tensors and attributes, several and non-tensor outputs, unused and non-differentiable outputs,
a Function applied in several places; torch's reentrant checkpoint runs inline, with eager's
gradients; ``mark_dirty`` is refused with what to do instead."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import AutodiffError, TraceError
from tests.capture._eager import train_like_eager

STEPS = 3


class RoundSTE(torch.autograd.Function):
    """Old style: rounds; the gradient is a straight-through one, scaled by an attribute and
    gated by a saved input (zero outside [-limit, limit])."""

    @staticmethod
    def forward(ctx, x, scale, limit):
        ctx.save_for_backward(x)
        ctx.scale, ctx.limit = scale, limit
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * ctx.scale * (x.abs() <= ctx.limit), None, None


class SplitScale(torch.autograd.Function):
    """New style: three outputs (two tensors and an int), the second marked non-differentiable;
    the backward reads a saved output and a tensor kept as an attribute, in a dict."""

    @staticmethod
    def forward(x, w):
        return torch.sin(x) * w, torch.argmax(x, dim=-1), 7

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w = inputs
        ctx.save_for_backward(output[0], None)
        ctx.kept = {"x": x, "w": w}
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad, grad_index, grad_int):
        out, nothing = ctx.saved_tensors
        x, w = ctx.kept["x"], ctx.kept["w"]
        assert nothing is None and grad_int is None and not ctx.needs_input_grad[2:]
        assert grad_index is not None and grad_index.shape == out.shape[:-1]  # materialized, as eager
        return grad * torch.cos(x) * w + 0.0 * out, (grad * torch.sin(x)).sum(0)


class ReverseGrad(torch.autograd.Function):
    """The gradient reversal layer (domain adaptation): identity forward, -alpha * grad back."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = RoundSTE.apply(self.a(x) * 3, 0.5, 2.0) / 3
        h, index, seven = SplitScale.apply(self.b(h), self.w)
        h = ReverseGrad.apply(h, 0.25) + ReverseGrad.apply(h * 2, 1.5)  # one Function, two places
        out = self.head(h) + index.unsqueeze(-1) * 0 + seven * 0
        return out, F.cross_entropy(out, y)


def _batch():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_functions_train_with_their_own_backward_as_eagerly(optimizer):
    torch.manual_seed(0)
    train_like_eager(Model(), _batch(), steps=STEPS, optimizer=optimizer)


def test_the_functions_own_gradient_is_used_not_the_forwards():
    """round's own derivative is zero: a step that trained through the traced forward's ops
    would leave ``a`` unchanged; the straight-through backward moves it, as eagerly."""
    torch.manual_seed(0)
    model = Model()
    before = model.a.weight.detach().clone()
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    ipu(*_batch())
    ipu.copyWeightsToHost()
    assert (model.a.weight.detach() - before).abs().max() > 1e-4


def test_an_inference_model_runs_the_functions_forward():
    torch.manual_seed(0)
    model = Model().eval()
    x, y = _batch()
    out, loss = poptorch.inferenceModel(model)(x, y)
    eager_out, eager_loss = model(x, y)
    torch.testing.assert_close(out, eager_out)
    torch.testing.assert_close(loss, eager_loss)


class _Doubler(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _Applies(nn.Module):
    """A linear layer, then ``function.apply``; the loss is the output's sum."""

    def __init__(self, function):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.function = function

    def forward(self, x):
        out = self.function.apply(self.lin(x))
        return out, out.sum()


def _train_step(model, *batch):
    return poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(*batch)


class _SavesAnInt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, 3)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_saving_a_non_tensor_raises_eagers_type_error():
    with pytest.raises(TypeError) as eager:
        _SavesAnInt.apply(torch.ones(2, requires_grad=True))
    with pytest.raises(TypeError, match="argument 1 is of type int") as info:
        _train_step(_Applies(_SavesAnInt), torch.randn(2, 3))
    assert isinstance(info.value, TraceError) and str(eager.value) in str(info.value)


def test_an_in_place_function_is_refused_with_the_fix():
    with pytest.raises(TraceError, match="_Doubler modifies its input in place") as info:
        _train_step(_Applies(_Doubler), torch.randn(2, 3))
    assert "return a new tensor" in info.value.fix


class _Clipped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad if grad.abs().max() < 1 else grad.clamp(-1, 1)  # decides on the gradient's values


def test_a_backward_that_reads_values_is_refused_with_its_line():
    with pytest.raises(AutodiffError, match="backward of the custom autograd.Function .*_Clipped failed") as info:
        _train_step(_Applies(_Clipped), torch.randn(2, 3))
    assert "test_custom_functions.py" in info.value.where and "in backward" in info.value.where
    assert "torch.where" in info.value.fix


class _Checkpointed(nn.Module):
    def __init__(self, reentrant, input_grad=True):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)
        self.reentrant, self.input_grad = reentrant, input_grad

    def forward(self, x, y):
        h = x * self.b.weight.sum() if self.input_grad else x  # an input that requires grad, or data
        out = self.b(checkpoint(lambda t, k: torch.tanh(self.a(t)) * k, h, 2, use_reentrant=self.reentrant))
        return out, F.mse_loss(out, y)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_torchs_checkpoint_trains_as_eagerly(reentrant):
    torch.manual_seed(0)
    train_like_eager(_Checkpointed(reentrant), (torch.randn(5, 4), torch.randn(5, 3)), steps=STEPS, lr=0.1)


def test_a_reentrant_checkpoint_of_data_warns_and_trains_nothing_inside_as_eagerly():
    """No argument requires grad: eager warns and its outputs carry no gradient, so ``a`` (inside)
    stays as it was while ``b`` trains."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    model = _Checkpointed(True, input_grad=False)
    eager = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        eager(x, y)[1].backward()
    assert eager.a.weight.grad is None and eager.b.weight.grad is not None
    before = copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        _train_step(model, x, y)
    after = model.state_dict()
    torch.testing.assert_close(after["a.weight"], before["a.weight"])
    assert not torch.equal(after["b.weight"], before["b.weight"])


class _TorchsOwn(torch.autograd.Function):
    """An old-style Function that torch itself would define (it is not intercepted)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


_TorchsOwn.__module__ = "torch.utils._probe"


def test_an_old_style_function_of_torchs_own_is_named_with_what_to_do():
    with pytest.raises(TraceError, match="it calls torch.utils._probe._TorchsOwn, which torch's functional") as info:
        _train_step(_Applies(_TorchsOwn), torch.randn(2, 3))
    assert "call its forward's ops instead" in info.value.fix and "test_custom_functions.py" in info.value.where


def test_functions_outside_a_capture_are_torchs():
    """The interception lasts only as long as a capture: afterwards apply is torch's again."""
    poptorch.inferenceModel(Model().eval())(*_batch())
    x = torch.randn(4, requires_grad=True)
    RoundSTE.apply(x * 3, 1.0, 10.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_a_functions_record_lives_as_long_as_its_program():
    """What a captured Function's backward needs is held by its node: a program that is gone
    frees it, so a process that compiles again and again does not accumulate them."""
    import gc

    from ipuxl.capture import custom_functions

    def records():
        gc.collect()
        return [r for r in custom_functions._ROUTED.values() if r.cls is _Twice]

    model = _Applies(_Twice)
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ipu(torch.randn(2, 3))
    assert len(records()) == 1
    del ipu, model
    assert records() == []
