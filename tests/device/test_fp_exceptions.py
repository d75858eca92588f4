"""The IPU's floating-point exceptions (``enableFloatingPointChecks``): with the option, a
step stops at the first arithmetic that makes NaN, reads NaN or overflows, reported at that
op and the user's line; without it (the default) NaN and infinity pass as in eager PyTorch.
A checked training program that stays finite gives eager's weights."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import ipuxl
import ipuxl.ops as ops
from ipuxl.device.cuda_graphs import host_reads
from ipuxl.device.fp_checks import insert_checks
from ipuxl.errors import ApplicationRuntimeError, DeviceError, PoptorchError

INF, NAN = float("inf"), float("nan")


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _checked(fn, checks: bool | None):
    options = ipuxl.Options()
    if checks is not None:
        options.Precision.enableFloatingPointExceptions(checks)
    return ipuxl.inferenceModel(Fn(fn), options)


# upstream's exception_test cases, and what each exception is
CASES = {
    "div0": (lambda x, y: x / y, (torch.ones(4, 4), torch.zeros(4, 4)), "division by zero or overflow", "div"),
    "mul0inf": (lambda x, y: x * y, (torch.zeros(4), torch.full((4,), INF)), "invalid operation", "mul"),
    "nonreal": (torch.sqrt, (torch.tensor([-1.0, -2.0]),), "invalid operation", "sqrt"),
    "nan_compare": (lambda x, y: x > y, (torch.ones(3), torch.full((3,), NAN)), "invalid operation", "gt"),
    "overflow": (torch.exp, (torch.tensor([3800.0, 1.0]),), "division by zero or overflow", "exp"),
    "half_overflow": (lambda x: x * 2, (torch.full((2,), 60000.0, dtype=torch.float16),),
                      "division by zero or overflow", "mul"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_exception_stops_the_step_at_its_op(case):
    fn, args, kind, op = CASES[case]
    with pytest.raises(DeviceError, match=rf"at op '{op}' \(from .*test_fp_exceptions.py:\d+ in ") as info:
        _checked(fn, True)(*args)
    assert isinstance(info.value, PoptorchError) and isinstance(info.value, FloatingPointError)
    assert isinstance(info.value, ApplicationRuntimeError)  # popart.poplar_application_runtime_error
    assert f"floating-point exception ({kind})" in str(info.value)
    assert info.value.failed_op == op and "enableFloatingPointExceptions(False)" in str(info.value)


@pytest.mark.parametrize("checks", [None, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_without_the_option_the_values_are_eagers(case, checks):
    fn, args, _, _ = CASES[case]
    torch.testing.assert_close(_checked(fn, checks)(*args), fn(*args), equal_nan=True)


def test_infinity_and_nan_pass_through_data_movement_and_infinite_operands():
    def fn(x, m):
        y = torch.where(m, x, torch.full_like(x, -INF))  # a mask of -inf, as attention builds
        z = torch.cat([y, x]).reshape(2, 3).t()  # moved, not computed
        return z + 1, torch.softmax(y, 0)  # inf + 1 is inf: no new infinity; exp(-inf) is 0

    x, mask = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, False, True])
    for out, ref in zip(_checked(fn, True)(x, mask), fn(x, mask)):
        torch.testing.assert_close(out, ref)


def test_a_checked_training_program_gives_eagers_weights():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))

    class Loss(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            out = self.net(x)
            return out, nn.functional.cross_entropy(out, y)

    eager = copy.deepcopy(net)
    options = ipuxl.Options().deviceIterations(2)
    options.Precision.enableFloatingPointExceptions(True)
    model = Loss(net)
    ipu = ipuxl.trainingModel(model, options, optimizer=torch.optim.AdamW(net.parameters(), lr=0.01))
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=0.01)
    x, y = torch.randn(3, 2, 6), torch.randint(0, 3, (3, 2, 1))
    for step in range(3):
        ipu(x[step].repeat(2, 1), y[step].repeat(2, 1).flatten())
        for _ in range(2):
            eager_opt.zero_grad()
            nn.functional.cross_entropy(eager(x[step]), y[step].flatten()).backward()
            eager_opt.step()
    for (name, a), b in zip(net.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_an_update_that_overflows_is_caught_in_the_optimiser_step():
    net = nn.Linear(2, 1)
    options = ipuxl.Options()
    options.Precision.enableFloatingPointExceptions(True)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x).sum()

    ipu = ipuxl.trainingModel(Loss(), options, optimizer=torch.optim.SGD(net.parameters(), lr=3e38))
    with pytest.raises(DeviceError, match="division by zero or overflow"):
        ipu(torch.full((1, 2), 10.0))


def test_popxl_session_options_and_the_poplar_engine_option():
    def program(setting):
        ir = ipuxl.Ir()
        setting(ir._pb_ir.getSessionOptions())
        with ir.main_graph:
            x = ipuxl.variable(np.array([0.0, 1.0], np.float32), name="x")
            out = ipuxl.d2h_stream((2,), ipuxl.float32, "out")
            ops.host_store(out, ops.log(x))  # log(0) is -inf: a division by zero on an IPU
        return ir, out

    for setting in (lambda o: setattr(o, "enableFloatingPointChecks", True),
                    lambda o: o.engineOptions.update({"debug.floatPointOpException": "true"})):
        ir, _ = program(setting)
        with ipuxl.Session(ir, "cpu") as session, pytest.raises(FloatingPointError, match="at op 'log'"):
            session.run()
    ir, out = program(lambda o: None)
    with ipuxl.Session(ir, "cpu") as session:
        assert session.run()[out].tolist() == [-INF, 0.0]


def test_checks_wrap_arithmetic_only_and_a_checked_program_is_never_graphed():
    aten = torch.fx.Graph()
    x = aten.placeholder("x")
    view = aten.call_function(torch.ops.aten.view.default, (x, [-1]))
    mul = aten.call_function(torch.ops.aten.mul.Tensor, (view, 2))
    aten.output(aten.call_function(torch.ops.aten.exp.default, (mul,)))
    assert insert_checks(aten) == 2  # mul and exp, not the view
    order = [n.target.__name__ if callable(n.target) and not hasattr(n.target, "_overloadpacket")
             else str(n.target) for n in aten.nodes if n.op == "call_function"]
    assert order == ["aten.view.default", "operands", "aten.mul.Tensor", "results", "operands",
                     "aten.exp.default", "results"]

    options = ipuxl.Options()
    options.Precision.enableFloatingPointExceptions(True)
    model = ipuxl.inferenceModel(Fn(lambda x: x * 2), options)
    model(torch.ones(2))
    reason = host_reads([model.session.programs[0], *(c.module for g in model.session.ir.graphs
                                                      if (c := model.session.compiled_graph(g)))])
    assert reason is not None and "fp_exceptions" in reason, reason
