"""PopTorch's host ops (``ipu_print_tensor``, ``CPU``, ``custom_op``: ``ipuxl.poptorch_compat.ops.host``)
inside ``inferenceModel``/``trainingModel``, against eager PyTorch."""
from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import DeviceError, OpArgumentError, OpContextError
from ipuxl.poptorch_compat import ops as poptorch_ops
from tests.poptorch_compat._checks import raises_in
from tests.poptorch_compat.ops._harness import TOL, Wrap, assert_same_weights, train_both

raises = raises_in(__file__)


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
