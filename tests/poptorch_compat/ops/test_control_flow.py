"""PopTorch's control flow (``poptorch.for_loop``, ``cond``: ``ipuxl.poptorch_compat.ops.control_flow``)
inside ``inferenceModel``/``trainingModel``, against eager PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import OpArgumentError, OpContextError, PoptorchError
from tests.poptorch_compat._checks import raises_in
from tests.poptorch_compat.ops._harness import TOL, Wrap, assert_same_weights, train_both

raises = raises_in(__file__)


# -- for_loop -------------------------------------------------------------------------------------
def test_for_loop_multiple_inputs_equal_a_python_loop():
    def body(x, y, z, w):
        return x * y, y + z, x * w, w + 1

    model = Wrap(lambda m, x, y, z, w: poptorch.for_loop(10, body, [x, y, z, w]))
    inputs = [torch.rand(3) for _ in range(4)]
    out = poptorch.inferenceModel(model)(*inputs)
    state = list(inputs)
    for _ in range(10):
        state = list(body(*state))
    for got, want in zip(out, state):
        torch.testing.assert_close(got, want, **TOL)


def test_for_loop_passes_inputs_by_value():
    def body(y):
        y += 1
        return y

    model = Wrap(lambda m, x: poptorch.for_loop(3, body, [x])[0])
    x = torch.ones(1, 5, dtype=torch.int32)
    out = poptorch.inferenceModel(model)(x)
    assert out.dtype == torch.int32
    torch.testing.assert_close(out, torch.full((1, 5), 4, dtype=torch.int32))
    torch.testing.assert_close(x, torch.ones(1, 5, dtype=torch.int32))  # the caller's tensor is unchanged


def test_for_loop_trains_like_eager():
    def forward(m, x, y):
        out = poptorch.for_loop(3, lambda a: torch.tanh(m.fc(a)), [x])[0]
        return out, F.mse_loss(out, y)

    torch.manual_seed(0)
    device, eager = train_both(Wrap(forward, fc=nn.Linear(4, 4)), (torch.randn(2, 4), torch.randn(2, 4)))
    assert_same_weights(device, eager)


def test_for_loop_float16_and_bool_keep_values_and_dtypes():
    model = Wrap(lambda m, x, mask: poptorch.for_loop(3, lambda a, b: (a * 2, ~b), [x, mask]))
    x, mask = torch.randn(4).half(), torch.tensor([True, False, True, True])
    out, ref = poptorch.inferenceModel(model)(x, mask), model(x, mask)
    assert [t.dtype for t in out] == [torch.float16, torch.bool]
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1], ~mask)


def test_for_loop_zero_iterations_returns_the_inputs():
    x = torch.randn(3)
    out = poptorch.inferenceModel(Wrap(lambda m, x: poptorch.for_loop(0, lambda a: a * 2, [x])[0]))(x)
    torch.testing.assert_close(out, x)


@pytest.mark.parametrize("inputs, fragment", [
    (lambda x: x, "(Object is not list)"),
    (lambda x: [x, 5], "(Object contained in list at index 1 is not torch.tensor)"),
])
def test_for_loop_refuses_inputs_that_are_not_a_list_of_tensors(inputs, fragment):
    model = Wrap(lambda m, x: poptorch.for_loop(10, lambda *a: a, inputs(x)))
    with raises(OpArgumentError, fragment) as info:
        poptorch.inferenceModel(model)(torch.ones(2))
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("body, fragment", [
    (lambda a, b: a, "returned ['(2,) torch.float32']"),
    (lambda a, b: (a, b.sum()), "'() torch.float32'"),
    (lambda a, b: (a, b.int()), "torch.int32"),
])
def test_for_loop_body_outputs_must_match_its_inputs(body, fragment):
    model = Wrap(lambda m, x, y: poptorch.for_loop(2, body, [x, y]))
    with raises(OpArgumentError, "poptorch.for_loop: the body must return", fragment):
        poptorch.inferenceModel(model)(torch.ones(2), torch.ones(2))


# -- cond ------------------------------------------------------------------------------------------
def cond_model(then_body, then_args, else_body, else_args):
    def forward(m, condition, x, y):
        local = {"x": x, "y": y}
        return poptorch.cond(condition, then_body, [local[a] for a in then_args], else_body,
                             [local[a] for a in else_args])
    return Wrap(forward)


@pytest.mark.parametrize("condition", [torch.tensor([True]), torch.tensor(True)])
def test_cond_takes_the_branch_of_the_runtime_condition(condition):
    model = cond_model(lambda a: (a * 4, a + 1), "x", lambda b: (b, b - 1), "y")
    inference = poptorch.inferenceModel(model)
    x, y = torch.rand(3), torch.rand(3)
    for value in (True, False):
        flag = torch.full_like(condition, value)
        for got, want in zip(inference(flag, x, y), model(flag, x, y)):
            torch.testing.assert_close(got, want, **TOL)


def test_cond_branches_use_the_callers_tensors_and_nest():
    def forward(m, condition, nested, x, y):
        def then_body():
            return poptorch.cond(nested, lambda a, b: a + b, [x, y], lambda: x - y, [])[0]

        def else_body(flag):
            return poptorch.cond(torch.logical_not(flag), lambda b: x * b, [y], lambda: x * 2, [])[0]

        return poptorch.cond(condition, then_body, [], else_body, [nested])[0]

    model = Wrap(forward)
    inference = poptorch.inferenceModel(model)
    x, y = torch.rand(2), torch.rand(2)
    for c in (True, False):
        for n in (True, False):
            args = (torch.tensor([c]), torch.tensor([n]), x, y)
            torch.testing.assert_close(inference(*args), model(*args), **TOL)


def test_cond_bool_and_float16_outputs_keep_dtypes():
    model = cond_model(lambda a, b: (a > 0, b.half()), "xy", lambda a, b: (a < 0, (b * 2).half()), "xy")
    inference = poptorch.inferenceModel(model)
    x, y = torch.randn(4), torch.randn(4)
    for flag in (True, False):
        out, ref = inference(torch.tensor([flag]), x, y), model(torch.tensor([flag]), x, y)
        assert [t.dtype for t in out] == [torch.bool, torch.float16]
        for got, want in zip(out, ref):
            torch.testing.assert_close(got, want)


def test_cond_eagerly_runs_only_the_taken_branch():
    ran = []
    out = poptorch.cond(torch.tensor([False]), lambda: ran.append("then") or torch.ones(1), [],
                        lambda: ran.append("else") or torch.zeros(1), [])
    assert ran == ["else"] and isinstance(out, list)
    torch.testing.assert_close(out[0], torch.zeros(1))


def test_cond_is_for_inference_as_in_poptorch():
    def forward(m, condition, x):
        out = poptorch.cond(condition, lambda a: m.fc(a), [x], lambda a: m.fc(a) * 2, [x])[0]
        return out, poptorch.identity_loss(out, reduction="sum")

    model = Wrap(forward, fc=nn.Linear(4, 4))
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with raises(OpContextError, "poptorch.cond() is only supported in inference") as info:
        training(torch.tensor([True]), torch.ones(1, 4))
    assert isinstance(info.value, PoptorchError)


@pytest.mark.parametrize("model, fragment", [
    (cond_model(lambda a: (a, a), "x", lambda b: b, "y"), "have to return the same number of outputs"),
    (cond_model(lambda a: a.sum(), "x", lambda b: b, "y"), "of one shape and dtype"),
    (Wrap(lambda m, c, x, y: poptorch.cond(c, lambda a: a, x, lambda b: b, [y])), "(Object is not list)"),
])
def test_cond_refuses_branches_that_do_not_correspond(model, fragment):
    with raises(OpArgumentError, fragment):
        poptorch.inferenceModel(model)(torch.tensor([True]), torch.ones(2), torch.ones(2))


def test_cond_condition_must_have_one_element():
    model = cond_model(lambda a: a, "x", lambda b: b, "y")
    with raises(OpArgumentError, "the condition must have one element"):
        poptorch.inferenceModel(model)(torch.tensor([True, False]), torch.ones(2), torch.ones(2))
