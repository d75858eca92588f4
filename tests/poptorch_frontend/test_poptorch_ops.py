"""PopTorch's ops (``poptorch.for_loop``, ``cond``, ``dynamic_slice``, ``ipu_print_tensor``,
``CPU``, ``custom_op``...) inside ``inferenceModel``/``trainingModel``, against eager PyTorch."""
from __future__ import annotations

import copy
import itertools
import re

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import DeviceError, OpArgumentError, OpContextError, PoptorchError
from ipuxl.poptorch_compat import ops as poptorch_ops
from tests.poptorch_compat._checks import as_poptorch, sgd_steps_like_eager
from tests.poptorch_compat._checks import raises_in

raises = raises_in(__file__)
TOL = dict(rtol=1e-5, atol=1e-6)


def train_both(model: nn.Module, inputs: tuple, steps: int = 3, lr: float = 0.1) -> tuple[nn.Module, nn.Module]:
    """``steps`` SGD steps of ``model`` on the device and of a copy eagerly; returns (device, eager).
    Outputs of every step are compared."""
    training, ref = sgd_steps_like_eager(model, inputs, steps, lr, TOL)
    training.destroy()
    return model, ref


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m, n=name: f"{n}: {m}", **TOL)


class Wrap(nn.Module):
    """A module whose forward is ``fn(self, *inputs)``."""

    def __init__(self, fn, **children: nn.Module):
        super().__init__()
        self.fn = fn
        for name, child in children.items():
            self.add_module(name, child)

    def forward(self, *inputs):
        return self.fn(self, *inputs)


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


# -- dynamic_slice / dynamic_update -----------------------------------------------------------------
@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_dynamic_slice_reads_the_start_at_run_time(step, dtype):
    model = Wrap(lambda m, t, s: poptorch.dynamic_slice(t, 1, s, 4, step))
    table = (torch.arange(16.0).reshape(2, 8) % 3).to(dtype)
    inference = poptorch.inferenceModel(model)
    for start in (1, 4, 0, 3):  # compiled with the first, run with the others
        got = inference(table, torch.tensor([start]))
        assert got.dtype == dtype
        torch.testing.assert_close(got, table[:, start:start + 4:step])
        torch.testing.assert_close(got, model(table, torch.tensor([start])))


def test_dynamic_slice_clamps_a_start_past_the_end():
    inference = poptorch.inferenceModel(Wrap(lambda m, t, s: poptorch.dynamic_slice(t, 0, s, 4, 1)))
    t = torch.arange(8.0)
    torch.testing.assert_close(inference(t, torch.tensor([7])), t[4:8])


def test_dynamic_slice_and_update_train_like_eager():
    def forward(m, x, s, y):
        h = m.fc(x)
        window = poptorch.dynamic_slice(h, 1, s, 2, 1)
        written = poptorch.dynamic_update(h, window * 3, 1, s + 2, 2)
        return written, F.mse_loss(written.sum(1), y)

    torch.manual_seed(0)
    device, eager = train_both(Wrap(forward, fc=nn.Linear(3, 8)), (torch.randn(4, 3), torch.tensor([1]),
                                                                   torch.randn(4)))
    assert_same_weights(device, eager)


def test_dynamic_update_writes_the_slice_at_run_time():
    inference = poptorch.inferenceModel(Wrap(lambda m, t, u, s: poptorch.dynamic_update(t, u, 0, s, 2)))
    t, u = torch.arange(8.0), torch.tensor([-1.0, -2.0])
    for start in (1, 5):
        want = t.clone()
        want[start:start + 2] = u
        torch.testing.assert_close(inference(t, u, torch.tensor([start])), want)


@pytest.mark.parametrize("call, fragment", [
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, 0, 1), "The start and end of a slice must be different."),
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, -2, 1), "end less than the start is not supported."),
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, 7, 1),
     "The size of the slice (7) must be a factor of the slicing dimension (8)."),
    (lambda t, s: poptorch.dynamic_slice(t, 0, 1, 2, 1), "Slice start argument to dynamic_slice must be a torch"),
    (lambda t, s: poptorch.dynamic_slice(t, 0.5, s, 2, 1), "Dimension must be an integer."),
    (lambda t, s: poptorch.dynamic_update(t, t[:2].int(), 0, s, 2), "must have same dtype"),
    (lambda t, s: poptorch.dynamic_update(t, t[:2, None], 0, s, 2), "must have same dimensionality"),
])
def test_dynamic_slice_and_update_refuse_bad_arguments(call, fragment):
    with raises(OpArgumentError, fragment):
        poptorch.inferenceModel(Wrap(lambda m, t, s: call(t, s)))(torch.arange(8.0), torch.tensor([1]))


# -- ipu_print_tensor -------------------------------------------------------------------------------
# PopTorch's own expected output for torch.rand((2, 2)) + 1 with torch.manual_seed(0)
UPSTREAM_PRINTS = [
    (("title", True, 1000, 3, 75, 8, "auto", " ", "{", "}"),
     "title: {\n {1.4962566 1.7682219}\n {1.0884774 1.1320305}\n}"),
    (("title", True, 500, 2, 15, 8, "scientific", ",", "[", "]"),
     "title: [\n [1.4962566e+00,\n   1.7682219e+00]\n [1.0884774e+00,\n   1.1320305e+00]\n]"),
    (("title", True, 1500, 1, 125, 8, "fixed", ";", "(", ")"),
     "title: (\n (1.4962566;1.7682219)\n (1.0884774;1.1320305)\n)"),
]


@pytest.mark.parametrize("args, expected", UPSTREAM_PRINTS)
def test_ipu_print_tensor_prints_poplars_layout_at_run_time(capfd, args, expected):
    model = Wrap(lambda m, x: poptorch.ipu_print_tensor(x + 1, *args) * 2)
    inference = poptorch.inferenceModel(model)
    torch.manual_seed(0)
    x = torch.rand((2, 2))
    capfd.readouterr()
    for _ in range(2):  # every execution prints
        torch.testing.assert_close(inference(x), (x + 1) * 2)
    assert capfd.readouterr().err.count(expected) == 2


def test_ipu_print_tensor_summarises_large_tensors(capfd):
    inference = poptorch.inferenceModel(Wrap(lambda m, x: poptorch.ipu_print_tensor(x, "big", edge_items=2) + 0))
    capfd.readouterr()
    inference(torch.arange(3000.0).reshape(30, 100))
    err = capfd.readouterr().err
    assert "big: (\n (   0.0,    1.0, ...,   98.0,   99.0)\n" in err and "\n ...\n" in err


def test_ipu_print_tensor_prints_the_gradient_in_training(capfd):
    def forward(m, x, y, print_gradient):
        h = poptorch.ipu_print_tensor(m.fc(x), "h", print_gradient=print_gradient, digits=6)
        return h, F.mse_loss(h, y)

    torch.manual_seed(0)
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    for print_gradient in (True, False):
        model = Wrap(lambda m, x, y: forward(m, x, y, print_gradient), fc=nn.Linear(3, 3))
        ref = copy.deepcopy(model)
        training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        capfd.readouterr()
        training(x, y)
        err = capfd.readouterr().err
        h = ref.fc(x).detach().requires_grad_()
        F.mse_loss(h, y).backward()
        assert err.count("h: (") == 1
        assert err.count("h_gradient: (") == (1 if print_gradient else 0)
        if print_gradient:
            printed = [float(v) for v in re.findall(r"-?\d+\.\d+", err.split("h_gradient:")[1])]
            torch.testing.assert_close(torch.tensor(printed).reshape(2, 3), h.grad, rtol=1e-4, atol=1e-5)
        training.destroy()


def test_ipu_print_tensor_keeps_dtype_and_refuses_bad_formats(capfd):
    for x, printed in ((torch.tensor([1.5, -2.0]).half(), "h: ( 1.500, -2.000)"),
                       (torch.tensor([True, False]), "h: (1, 0)")):
        out = poptorch.inferenceModel(Wrap(lambda m, x: poptorch.ipu_print_tensor(x, "h")))(x)
        assert out.dtype == x.dtype and printed in capfd.readouterr().err
        torch.testing.assert_close(out, x)
    with raises(OpArgumentError, "float_format must be one of"):
        poptorch.inferenceModel(Wrap(lambda m, x: poptorch.ipu_print_tensor(x, float_format="hex")))(torch.ones(2))


# -- identity-like ops and hints ----------------------------------------------------------------------
def test_hints_are_identities_in_a_trained_model():
    def forward(m, x, y):
        x = poptorch.set_overlap_for_input(x, poptorch.OverlapMode.OverlapAccumulationLoop)
        h = poptorch.serializedMatMul(x, m.w, poptorch.MatMulSerializationMode.OutputChannels, 2)
        h = poptorch.set_available_memory(poptorch.nop(h), 0.3)
        h, g = poptorch.recomputationCheckpoint(torch.tanh(h), h * 2)
        out = poptorch.set_overlap_for_output({"out": h + g}, poptorch.OverlapMode.NoOverlap)["out"]
        return out, F.mse_loss(out, y)

    torch.manual_seed(0)
    model = Wrap(forward)
    model.w = nn.Parameter(torch.randn(3, 4))
    device, eager = train_both(model, (torch.randn(5, 3), torch.randn(5, 4)))
    assert_same_weights(device, eager)


def test_recomputation_checkpoint_returns_what_it_was_given():
    a, b = torch.ones(1), torch.zeros(1)
    assert poptorch.recomputationCheckpoint(a) is a
    assert poptorch.recomputationCheckpoint(a, b) == (a, b)
    assert isinstance(poptorch.recomputationCheckpoint([a, b]), list)
    with pytest.raises(ValueError, match="All inputs must be tensors"):
        poptorch.recomputationCheckpoint(a, 3)


@pytest.mark.parametrize("call, fragment", [
    (lambda x: poptorch.serializedMatMul(x, x.T, "output_channels", 2), "must be a poptorch.MatMulSerializationMode"),
    (lambda x: poptorch.serializedMatMul(x, x.T, poptorch.MatMulSerializationMode.ReducingDim, 3),
     "factor 3 must be >= 1 and divide the reducing dimension (lhs dim -1) of length 4"),
    (lambda x: poptorch.serializedMatMul(x, x.T, poptorch.MatMulSerializationMode.InputChannels, 0),
     "factor 0"),
    (lambda x: poptorch.serializedMatMul(x, x.T, poptorch.MatMulSerializationMode.Disabled, 2, keep_precision=1),
     "keep_precision must be a bool"),
    (lambda x: poptorch.set_available_memory(x, 1.5), "must be a number in [0, 1], got 1.5"),
    (lambda x: poptorch.set_available_memory(3.0, 0.5), "You may only set available memory for torch.tensor"),
    (lambda x: poptorch.set_overlap_for_input([x, 2], poptorch.OverlapMode.NoOverlap), "You may only set overlap"),
    (lambda x: poptorch.set_overlap_for_output(x, "no_overlap"), "mode must be a poptorch.OverlapMode"),
    (lambda x: poptorch.nop(3), "nop must take a torch.tensor argument."),
])
def test_hints_check_their_arguments_as_poptorch(call, fragment):
    with raises(OpArgumentError, fragment):
        call(torch.ones(2, 4))


def test_multi_conv_trains_like_eager_and_checks_its_setters():
    def forward(m, x, y):
        multi = (poptorch.MultiConv().availableMemoryProportions([0.3, 0.4]).partialsTypes(torch.half)
                 .planType(poptorch.MultiConvPlanType.Serial).perConvReservedTiles(10).cycleBackOff(0.2)
                 .enableConvDithering(True))
        with multi:
            a, b = m.a(x), m.b(x)
        out = (a + b).mean((2, 3))
        return out, F.mse_loss(out, y)

    torch.manual_seed(0)
    model = Wrap(forward, a=nn.Conv2d(2, 3, 3, padding=1), b=nn.Conv2d(2, 3, 1))
    device, eager = train_both(model, (torch.randn(2, 2, 5, 5), torch.randn(2, 3)))
    assert_same_weights(device, eager)
    with raises(OpArgumentError, "Invalid available memory proportion!") as info:
        poptorch.MultiConv().availableMemoryProportions([0.1, 1])
    assert isinstance(info.value, AssertionError)
    with raises(OpArgumentError, "Invalid partials types") as info:
        poptorch.MultiConv().partialsTypes([torch.float, torch.int32])
    assert isinstance(info.value, ValueError)
    with raises(OpArgumentError, "Invalid plan type!"):
        poptorch.MultiConv().planType(0)
    with raises(OpArgumentError, "value must be bool or list of bools"):
        poptorch.MultiConv().enableConvDithering("yes")


# -- CPU (host callbacks) ----------------------------------------------------------------------------
class HostModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls: list[np.ndarray] = []
        self.cpu = poptorch.CPU(self.on_host, "MyCPUOp")

    def on_host(self, x):
        self.calls.append(x.numpy().copy())  # host code: numpy, not traceable
        return torch.from_numpy(np.cumsum(x.numpy(), axis=-1)), x.sum().reshape(1)

    def forward(self, x):
        cumulative, total = self.cpu(x * 2)
        return cumulative + 1, total


def test_cpu_op_runs_on_the_host_every_execution():
    model = HostModel()
    inference = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    x = torch.randn(4, 3)  # 2 device iterations of (2, 3)
    inference(x)  # compiles: the trace calls it once on zeros, as PopTorch does
    assert len(model.calls) == 3 and not model.calls[0].any()
    model.calls.clear()
    cumulative, total = inference(x)
    assert len(model.calls) == 2
    np.testing.assert_allclose(np.concatenate(model.calls), (x * 2).numpy(), rtol=1e-6)
    torch.testing.assert_close(cumulative, torch.cumsum(x * 2, -1) + 1, **TOL)
    torch.testing.assert_close(total, (x * 2).reshape(2, 6).sum(1), **TOL)
    assert model.cpu.in_shapes == [torch.Size([2, 3])] and model.cpu.out_shapes == [torch.Size([2, 3]),
                                                                                     torch.Size([1])]


def test_cpu_op_calls_the_function_eagerly_outside_a_model():
    model = HostModel()
    cumulative, total = model(torch.ones(2, 3))
    torch.testing.assert_close(cumulative, torch.tensor([[3.0, 5.0, 7.0]] * 2))


def test_cpu_op_must_keep_its_output_shapes():
    shapes = iter([(2,), (3,)])

    def changing(x):
        return torch.zeros(next(shapes))

    holder = Wrap(lambda m, x: m.host(x) + 0)
    holder.host = poptorch.CPU(changing, "changing")
    with pytest.raises(DeviceError, match="returned"):
        poptorch.inferenceModel(holder)(torch.ones(2))


def test_cpu_op_in_training_takes_only_values_without_gradient():
    def forward(m, x, y):
        scaled = m.host(x)  # an input: no gradient needed, allowed
        out = m.fc(scaled)
        return out, F.mse_loss(out, y)

    torch.manual_seed(0)
    model = Wrap(forward, fc=nn.Linear(3, 3))
    model.host = poptorch.CPU(lambda t: t * 3, "triple")
    device, eager = train_both(model, (torch.randn(2, 3), torch.randn(2, 3)))
    assert_same_weights(device, eager)

    bad = Wrap(lambda m, x, y: (m.host(m.fc(x)), F.mse_loss(m.host(m.fc(x)), y)), fc=nn.Linear(3, 3))
    bad.host = poptorch.CPU(lambda t: t * 3, "triple")
    training = poptorch.trainingModel(bad, optimizer=torch.optim.SGD(bad.parameters(), lr=0.1))
    with raises(OpContextError, "CPU ops are only supported in inference graphs"):
        training(torch.randn(2, 3), torch.randn(2, 3))


# -- custom_op -----------------------------------------------------------------------------------------
def test_python_custom_op_runs_and_trains_like_eager():
    poptorch_ops.register_custom_op("Cube", "com.acme", 1, lambda x, y, scale=1.0: (x ** 3 * scale, y * 2))

    def forward(m, x, y):
        h = m.fc(x)
        cubed, doubled = poptorch.custom_op([h, y], "Cube", "com.acme", 1, example_outputs=[h, y],
                                            attributes={"scale": 0.5})
        return cubed, F.mse_loss(cubed, doubled)

    def eager(m, x, y):
        cubed = m.fc(x) ** 3 * 0.5
        return cubed, F.mse_loss(cubed, y * 2)

    torch.manual_seed(0)
    model = Wrap(forward, fc=nn.Linear(3, 3))
    ref_model = Wrap(eager, fc=copy.deepcopy(model.fc))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    for _ in range(3):
        out, loss = training(x, y)
        optimizer.zero_grad()
        ref_out, ref_loss = ref_model(x, y)
        ref_loss.backward()
        optimizer.step()
        torch.testing.assert_close(out, ref_out.detach(), **TOL)
    assert_same_weights(model, ref_model)


@pytest.mark.parametrize("attributes, fragment", [
    ({1: 2}, "All attribute keys must be strings."),
    ({"a": None}, "Attribute values must be floats, ints, strings"),
    ({"a": [1, 2.0]}, "The types in a list/tuple attribute must all be the same."),
    ({"a": "caf\u00e9"}, "contains non-ASCII characters."),
])
def test_custom_op_checks_attributes_as_poptorch(attributes, fragment):
    poptorch_ops.register_custom_op("Id", "test.ops", 1, lambda x, **kw: x)
    with raises(OpArgumentError, fragment) as info:
        poptorch.custom_op([torch.ones(1)], "Id", "test.ops", 1, [torch.ones(1)], attributes)
    assert isinstance(info.value, ValueError)


def test_custom_op_without_a_python_implementation_is_refused():
    with raises(OpContextError, "PopART (C++) custom ops cannot run", "register_custom_op"):
        poptorch.custom_op([torch.ones(1)], "LeakyRelu", "com.unknown", 1, [torch.ones(1)])
    poptorch_ops.register_custom_op("Wrong", "test.ops", 1, lambda x: x.sum())
    with raises(OpArgumentError, "example_outputs promise"):
        poptorch.custom_op([torch.ones(2)], "Wrong", "test.ops", 1, [torch.ones(2)])


# -- ctc_beam_search_decoder ---------------------------------------------------------------------------
def brute_force_ctc(log_probs: torch.Tensor, length: int, blank: int) -> dict[tuple[int, ...], float]:
    """log P(labels) of every label sequence: the log-sum-exp over all its alignments."""
    totals: dict[tuple[int, ...], list[float]] = {}
    classes = log_probs.shape[1]
    for alignment in itertools.product(range(classes), repeat=length):
        merged = [c for i, c in enumerate(alignment) if c != blank and (i == 0 or c != alignment[i - 1])]
        score = float(sum(log_probs[t, c] for t, c in enumerate(alignment)))
        totals.setdefault(tuple(merged), []).append(score)
    return {labels: float(torch.logsumexp(torch.tensor(v, dtype=torch.float64), 0)) for labels, v in totals.items()}


def test_ctc_beam_search_decoder_finds_the_most_probable_label_sequences():
    torch.manual_seed(42)
    time, batch, classes = 5, 3, 3
    log_probs = torch.randn(time, batch, classes).log_softmax(-1)
    lengths = torch.tensor([5, 3, 4], dtype=torch.int32)
    model = Wrap(lambda m, p, n: poptorch.ctc_beam_search_decoder(p, n, blank=1, beam_width=64, top_paths=3))
    scores, sizes, paths = poptorch.inferenceModel(model)(log_probs, lengths)
    assert scores.shape == (batch, 3) and sizes.shape == (batch, 3) and paths.shape == (batch, 3, time)
    assert sizes.dtype == paths.dtype == torch.int32
    for b in range(batch):
        exact = brute_force_ctc(log_probs[:, b], int(lengths[b]), blank=1)
        best = sorted(exact.items(), key=lambda kv: -kv[1])[:3]
        for k, (labels, score) in enumerate(best):
            assert int(sizes[b, k]) == len(labels)
            assert tuple(paths[b, k, :len(labels)].tolist()) == labels and not paths[b, k, len(labels):].any()
            torch.testing.assert_close(float(scores[b, k]), score, rtol=1e-5, atol=1e-5)


def test_ctc_beam_search_decoder_checks_its_arguments():
    with raises(OpArgumentError, "ctc_beam_search_decoder: lengths must be a torch.tensor argument."):
        poptorch.ctc_beam_search_decoder(torch.zeros(4, 2, 3), [4, 4])
    with raises(OpArgumentError, "top_paths must be an int in [1, 2]"):
        poptorch.ctc_beam_search_decoder(torch.zeros(4, 2, 3), torch.tensor([4, 4]), beam_width=2, top_paths=3)
    with raises(OpArgumentError, "blank must be an int in [0, 2]"):
        poptorch.ctc_beam_search_decoder(torch.zeros(4, 2, 3), torch.tensor([4, 4]), blank=3)


# -- fps / nearest ------------------------------------------------------------------------------------
def numpy_fps(points: np.ndarray, count: int) -> list[int]:
    chosen, nearest = [0], ((points - points[0]) ** 2).sum(1)
    while len(chosen) < count:
        chosen.append(int(nearest.argmax()))
        nearest = np.minimum(nearest, ((points - points[chosen[-1]]) ** 2).sum(1))
    return chosen


def test_fps_samples_the_farthest_points_of_each_sample():
    torch.manual_seed(0)
    src, ptr = torch.randn(25, 3), [0, 10, 25]
    inference = poptorch.inferenceModel(Wrap(lambda m, s: poptorch.fps(s, ptr, 0.3)))
    for points in (src, src * 2 + 1):  # the sampling runs on each call's values
        got = inference(points)
        want = numpy_fps(points[:10].numpy(), 3) + [10 + i for i in numpy_fps(points[10:].numpy(), 5)]
        assert got.tolist() == want
    with raises(OpArgumentError, "`ptr` must containt at least 2 elements."):
        poptorch.fps(src, [0], 0.5)
    with raises(OpArgumentError, "`ratio` must be of float type."):
        poptorch.fps(src, ptr, 1)
    with raises(OpContextError, "random_start=True is not supported"):
        poptorch.fps(src, ptr, 0.5, random_start=True)


@pytest.mark.parametrize("as_list", [False, True])
def test_nearest_finds_the_closest_point_of_the_same_sample(as_list):
    torch.manual_seed(0)
    x, y = torch.randn(8, 2), torch.randn(5, 2)
    batch_x, batch_y = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]), torch.tensor([0, 0, 1, 1, 1])
    args = (batch_x.tolist(), batch_y.tolist()) if as_list else (batch_x, batch_y)
    got = poptorch.inferenceModel(Wrap(lambda m, a, b: poptorch.nearest(a, b, *args)))(x, y)
    distance = torch.cdist(x, y) + (batch_x[:, None] != batch_y[None, :]) * 1e9
    torch.testing.assert_close(got, as_poptorch(distance.argmin(1)))
    torch.testing.assert_close(poptorch.nearest(x, y), torch.cdist(x, y).argmin(1))


# -- identity_loss and the namespace ------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_identity_loss_reductions_train_like_eager(reduction):
    def forward(m, x, y):
        out = m.fc(x)
        per_sample = ((out - y) ** 2).sum(1)
        loss = per_sample.mean() if reduction == "none" else per_sample
        return out, poptorch.identity_loss(loss, reduction=reduction)

    torch.manual_seed(0)
    device, eager = train_both(Wrap(forward, fc=nn.Linear(3, 2)), (torch.randn(4, 3), torch.randn(4, 2)))
    assert_same_weights(device, eager)


def test_ops_are_poptorch_top_level_names():
    for name in ("for_loop", "cond", "dynamic_slice", "dynamic_update", "ipu_print_tensor", "nop",
                 "recomputationCheckpoint", "serializedMatMul", "set_available_memory", "set_overlap_for_input",
                 "set_overlap_for_output", "MultiConv", "NameScope", "CPU", "custom_op", "ctc_beam_search_decoder",
                 "fps", "nearest"):
        assert getattr(poptorch, name) is getattr(poptorch_ops, name)
    with poptorch.NameScope("encoder"):
        pass
    with raises(OpArgumentError, "Parameter to NameScope must be a string"):
        poptorch.NameScope(3)


def test_identity_loss_needs_one_of_the_three_reductions():
    """PopTorch 3.x: ``reduction`` is required; another value fails its assertion."""
    x = torch.ones(3)
    with pytest.raises(TypeError, match="reduction"):
        poptorch.identity_loss(x)  # type: ignore[call-arg]
    for error in (AssertionError, ValueError, poptorch.Error):
        with pytest.raises(error, match="reduction must be 'sum', 'mean' or 'none', got 'max'"):
            poptorch.identity_loss(x, "max")
    torch.testing.assert_close(poptorch.identity_loss(x * 2, "mean"), torch.tensor(2.0))
