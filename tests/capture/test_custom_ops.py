"""Operators made with ``torch.library.custom_op`` (how libraries written for torch.compile
wrap their kernels) train through ``trainingModel`` as eagerly: their ``register_autograd``
formula is their gradient (several outputs, keyword-only and list arguments, an output no
gradient reaches), ops inside a model's own ``autograd.Function``, ops that write a buffer in
place; missing fake implementations and formulas, formulas torch hides, and writes that would
need a gradient are refused with what to do."""
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
NS = "ipuxl_test_custom_ops"


# -- a formula with saved tensors and a non-tensor argument ----------------------------------------
@torch.library.custom_op(f"{NS}::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _tanh_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _tanh_backward(ctx, grad):
    (out,) = ctx.saved_tensors
    return grad * (ctx.scale - out * out / ctx.scale), None


scaled_tanh.register_autograd(_tanh_backward, setup_context=_tanh_setup)


# -- two outputs, a list argument, a keyword-only argument; the formula reads needs_input_grad ---
@torch.library.custom_op(f"{NS}::mix", mutates_args=())
def mix(xs: list[torch.Tensor], w: torch.Tensor, *, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return xs[0] * w + alpha * xs[1], xs[0] - xs[1]


@mix.register_fake
def _(xs, w, *, alpha=1.0):
    return torch.empty_like(xs[0]), torch.empty_like(xs[0])


NEEDS: list[tuple[bool, ...]] = []


def _mix_setup(ctx, inputs, keyword_only_inputs, output):
    xs, w = inputs
    ctx.save_for_backward(xs[0], w)
    ctx.alpha = keyword_only_inputs["alpha"]


def _mix_backward(ctx, grad_sum, grad_diff):
    x0, w = ctx.saved_tensors
    NEEDS.append(tuple(ctx.needs_input_grad))
    grad_w = (grad_sum * x0).sum(0) if ctx.needs_input_grad[1] else None
    return [grad_sum * w + grad_diff, ctx.alpha * grad_sum - grad_diff], grad_w


mix.register_autograd(_mix_backward, setup_context=_mix_setup)


class Model(nn.Module):
    def __init__(self, use_diff=True):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(6, 8)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.head = nn.Linear(8, 3)
        self.use_diff = use_diff

    def forward(self, x, y):
        h = scaled_tanh(self.a(x), 2.0)
        total, diff = mix([h, self.b(x)], self.w, alpha=0.5)
        out = self.head(total + diff if self.use_diff else total)
        return out, F.cross_entropy(out, y)


def _batch():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)


def _train_like_eager(model, *batch, optimizer=torch.optim.SGD):
    """``STEPS`` steps through ``trainingModel`` and eagerly: losses, then weights and buffers, equal."""
    train_like_eager(model, batch, steps=STEPS, optimizer=optimizer, buffers=True)


@pytest.mark.parametrize("use_diff", [True, False], ids=["both-outputs", "one-output-unused"])
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_custom_ops_train_with_their_registered_formula(use_diff, optimizer):
    torch.manual_seed(0)
    NEEDS.clear()
    Model()(*_batch())[1].backward()
    assert NEEDS == [([True, True], True)]  # eager's
    NEEDS.clear()
    _train_like_eager(Model(use_diff), *_batch(), optimizer=optimizer)
    # the formula saw eager's flags: one per argument given positionally, a list's one per element
    assert NEEDS and all(needs == ([True, True], True) for needs in NEEDS)


def test_the_formula_is_the_gradient_not_the_ops_own_derivative():
    """A formula that scales the true gradient by 3: the step follows it, as eager's does."""

    @torch.library.custom_op(f"{NS}::tripled_grad", mutates_args=())
    def tripled_grad(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    tripled_grad.register_fake(lambda x: torch.empty_like(x))
    tripled_grad.register_autograd(lambda ctx, grad: grad * 3)

    class Tripled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x, y):
            out = tripled_grad(self.lin(x))
            return out, F.mse_loss(out, y)

    torch.manual_seed(1)
    _train_like_eager(Tripled(), torch.randn(3, 4), torch.randn(3, 2))


@torch.library.custom_op(f"{NS}::normalize_input", mutates_args=())
def normalize_input(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5)


@normalize_input.register_fake
def _(x):
    return torch.empty_like(x)


class OnTheData(nn.Module):
    """A custom op with no formula on the input data, which needs no gradient."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x, y):
        out = self.lin(normalize_input(x))
        return out, F.cross_entropy(out, y)


def test_an_op_without_a_formula_is_fine_where_no_gradient_needs_it():
    torch.manual_seed(0)
    _train_like_eager(OnTheData(), *_batch())
    model = OnTheData()
    out, loss = poptorch.inferenceModel(model)(*_batch())
    torch.testing.assert_close(out, model(*_batch())[0])


def test_an_op_without_a_formula_that_a_gradient_needs_is_refused_as_eager_refuses_it():
    class Through(OnTheData):
        def forward(self, x, y):
            out = normalize_input(self.lin(x))
            return out, F.cross_entropy(out, y)

    model = Through()
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        model(*_batch())[1].backward()
    with pytest.raises(AutodiffError, match=f"custom op {NS}::normalize_input, which has no autograd "
                                            "formula") as info:
        poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(*_batch())
    assert "register_autograd" in info.value.fix and "test_custom_ops.py" in info.value.where


# -- the flash-attention pattern: a Function whose forward and backward are custom ops -----------
@torch.library.custom_op(f"{NS}::square_forward", mutates_args=())
def square_forward(x: torch.Tensor) -> torch.Tensor:
    return x * x


@torch.library.custom_op(f"{NS}::square_backward", mutates_args=())
def square_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return 2 * x * grad


square_forward.register_fake(lambda x: torch.empty_like(x))
square_backward.register_fake(lambda x, grad: torch.empty_like(x))


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return square_forward(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return square_backward(x, grad)


class SquareModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.head(Square.apply(self.a(x)))
        return out, F.cross_entropy(out, y)


def test_a_function_built_of_custom_ops_trains_as_eagerly():
    torch.manual_seed(0)
    _train_like_eager(SquareModel(), *_batch())


# -- an op that writes a buffer in place ------------------------------------------------------------
@torch.library.custom_op(f"{NS}::running_max_", mutates_args={"state"})
def running_max_(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    state.copy_(torch.maximum(state, x.detach().amax(0)))
    return x / state


@running_max_.register_fake
def _(state, x):
    return torch.empty_like(x)


class Tracks(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.ones(6))
        self.lin = nn.Linear(6, 3)

    def forward(self, x, y):
        out = self.lin(running_max_(self.seen, x * 2))
        return out, F.cross_entropy(out, y)


def test_an_op_that_writes_a_buffer_updates_it_as_eagerly():
    torch.manual_seed(0)
    model = Tracks()
    _train_like_eager(model, *_batch())
    assert (model.seen > 1).any()  # the op wrote it
    x, y = _batch()
    inference = Tracks()
    eager = copy.deepcopy(inference)
    for scale in (1.0, 3.0):
        torch.testing.assert_close(poptorch.inferenceModel(inference)(x * scale, y)[0], eager(x * scale, y)[0])


def test_an_op_that_writes_a_tensor_needing_a_gradient_is_refused():
    class WritesActivation(Tracks):
        def forward(self, x, y):
            h = self.lin(x)
            out = running_max_(h, x[:, :3])
            return out, F.cross_entropy(out, y)

    model = WritesActivation()
    with pytest.raises(TraceError, match=f"custom op {NS}::running_max_ writes its argument 'state' in place, "
                                         "and that tensor needs a gradient") as info:
        poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(*_batch())
    assert "mutates_args=()" in info.value.fix


# -- what tracing needs and cannot read --------------------------------------------------------------
@torch.library.custom_op(f"{NS}::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


_lib = torch.library.Library(NS, "FRAGMENT")
_lib.define("cpu_only(Tensor x) -> Tensor")
_lib.impl("cpu_only", lambda x: x * 2, "CPU")
_lib.define("cube(Tensor x) -> Tensor")
_lib.impl("cube", lambda x: x ** 3, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NS}::cube", lambda x: torch.empty_like(x), lib=_lib)
torch.library.register_autograd(f"{NS}::cube", lambda ctx, grad: 3 * ctx.saved_tensors[0] ** 2 * grad,
                                setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]), lib=_lib)


class Calls(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.op = op

    def forward(self, x, y):
        out = self.op(self.lin(x))
        return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("op", [no_fake, torch.ops.ipuxl_test_custom_ops.cpu_only],
                         ids=["custom_op", "library-cpu-kernel"])
def test_an_op_without_a_fake_implementation_says_to_register_one(op):
    model = Calls(op)
    with pytest.raises(TraceError) as info:
        poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(*_batch())
    assert "torch.library.register_fake" in info.value.fix and "test_custom_ops.py" in info.value.where


def test_a_formula_registered_on_a_library_op_is_named_with_the_fix():
    model = Calls(torch.ops.ipuxl_test_custom_ops.cube)
    model(*_batch())[1].backward()  # eager runs it
    with pytest.raises(AutodiffError, match=f"custom op {NS}::cube: its autograd formula was registered") as info:
        poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(*_batch())
    assert "@torch.library.custom_op" in info.value.fix and "test_custom_ops.py" in info.value.where


@pytest.mark.parametrize("returned, match", [
    ((None, None, None), r"returned 3 gradients \(expected 2: one per argument\)"),
    ("raise", r"backward formula of the custom op .*::bad_formula failed while ipuxl traced it: "
              r"ValueError: formula broke"),
])
def test_a_broken_formula_is_an_autodiff_error(returned, match):
    @torch.library.custom_op(f"{NS}::bad_formula", mutates_args=())
    def bad_formula(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale

    bad_formula.register_fake(lambda x, scale: torch.empty_like(x))

    def backward(ctx, grad):
        if returned == "raise":
            raise ValueError("formula broke")
        return returned

    bad_formula.register_autograd(backward)
    model = Calls(lambda h: bad_formula(h, 2.0))
    with pytest.raises(AutodiffError, match=match):
        poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(*_batch())
