"""A PopTorch optimiser's ``ipu_state`` / ``ipu_param``: read from the device, loaded onto it."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import ExecutorError


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        out = self.lin(x)
        return out, poptorch.identity_loss(out ** 2, reduction="sum")


_X = torch.randn(2, 3)


def _trained(opt_cls, **kwargs):
    torch.manual_seed(0)
    net = _Net()
    opt = opt_cls(net.parameters(), **kwargs)
    return net, opt, poptorch.trainingModel(net, optimizer=opt)


def test_state_is_none_before_compiling_and_popart_named_after():
    net, opt, model = _trained(poptorch.optim.Adam, lr=0.05, weight_decay=0.025, loss_scaling=0.75)
    before = opt.state_dict()
    assert before["ipu_state"] is None and before["ipu_param"] is None and "param_groups" in before
    model.compile(_X)
    after = opt.state_dict()
    assert set(after["ipu_state"]) == {f"{p}___model.lin.{n}" for p in ("Accl1", "Accl2", "Step")
                                       for n in ("weight", "bias")}
    torch.testing.assert_close(after["ipu_param"]["learningRate___specific___model.lin.bias"], torch.tensor(0.05))
    torch.testing.assert_close(after["ipu_param"]["weightDecay___specific___model.lin.weight"], torch.tensor(0.025))
    torch.testing.assert_close(after["ipu_param"]["lossScaling_FLOAT"], torch.tensor(0.75))
    model(_X)
    stepped = opt.state_dict()
    # Accl1 is torch's exp_avg, read from the device after the step
    torch.testing.assert_close(stepped["ipu_state"]["Accl1___model.lin.weight"], stepped["state"][0]["exp_avg"])
    assert not torch.equal(stepped["ipu_state"]["Accl1___model.lin.weight"],
                           after["ipu_state"]["Accl1___model.lin.weight"])


def test_sgd_without_momentum_reports_popart_compound_scalars():
    net, opt, model = _trained(poptorch.optim.SGD, lr=0.05, weight_decay=0.025, loss_scaling=0.75)
    model.compile(_X)
    param = opt.state_dict()["ipu_param"]
    torch.testing.assert_close(param["scaledLearningRate0___specific___model.lin.bias"], torch.tensor(0.05 / 0.75))
    torch.testing.assert_close(param["weightDecayScaleFactor0___specific___model.lin.weight"],
                               torch.tensor(1 - 0.05 * 0.025))


def test_a_torch_optimizer_keeps_torchs_state_dict():
    net, opt, model = _trained(torch.optim.Adam, lr=0.05)
    model(_X)
    assert "ipu_state" not in opt.state_dict()


def test_a_loaded_state_reaches_the_device():
    net, opt, model = _trained(poptorch.optim.Adam, lr=0.0)
    model.compile(_X)
    saved = opt.state_dict()
    for key, value in saved["ipu_state"].items():
        saved["ipu_state"][key] = torch.full_like(value, 0.5) if "Accl" in key else value
    saved["ipu_param"]["lossScaling_FLOAT"] = torch.tensor(4.0)
    opt.load_state_dict(saved)
    loaded = opt.state_dict()
    torch.testing.assert_close(loaded["ipu_state"]["Accl1___model.lin.weight"], torch.full((3, 3), 0.5))
    model(_X)  # lr 0: the weights stay, the moments move from 0.5 by the Adam rule
    ran = opt.state_dict()
    eager = copy.deepcopy(net)
    eager(_X)[1].backward()
    expected = 0.9 * 0.5 + 0.1 * eager.lin.weight.grad  # beta1 0.9, on the loaded moment
    torch.testing.assert_close(ran["ipu_state"]["Accl1___model.lin.weight"], expected)
    torch.testing.assert_close(ran["ipu_param"]["lossScaling_FLOAT"], torch.tensor(4.0))


def test_a_checkpoint_restores_into_a_new_model():
    net, opt, model = _trained(poptorch.optim.Adam, lr=0.01)
    model(_X)
    saved = copy.deepcopy(opt.state_dict())
    model.destroy()
    new_opt = poptorch.optim.Adam(net.parameters(), lr=0.01)
    new_opt.load_state_dict(saved)
    again = poptorch.trainingModel(net, optimizer=new_opt)
    again.compile(_X)
    restored = new_opt.state_dict()
    for key, value in saved["ipu_state"].items():
        torch.testing.assert_close(restored["ipu_state"][key], value)


def test_only_poptorch_optimizer_states_load():
    net = _Net()
    cpu = torch.optim.Adam(net.parameters())
    net(_X)[1].backward()
    cpu.step()
    with pytest.raises(ExecutorError, match="Only IPU optimizer states can be loaded onto the IPU.") as info:
        poptorch.optim.Adam(net.parameters()).load_state_dict(cpu.state_dict())
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(RuntimeError, match="because it is empty"):
        poptorch.optim.Adam(net.parameters()).load_state_dict({})
    # upstream's escape hatch: a torch state dict with empty PopTorch entries
    poptorch.optim.Adam(net.parameters()).load_state_dict({"ipu_state": None, "ipu_param": None,
                                                           **cpu.state_dict()})


def test_reads_are_cached_until_the_device_changes(caplog):
    net, opt, model = _trained(poptorch.optim.SGD, lr=0.0)
    model.compile(_X)
    caplog.set_level(logging.DEBUG, logger="poptorch:cpp")
    caplog.set_level(logging.DEBUG, logger="poptorch::python")

    def messages():
        out = [r.getMessage() for r in caplog.records if "optimiser state" in r.getMessage()]
        caplog.clear()
        return out

    opt.state_dict()
    assert messages() == ["Writing optimiser state tensors from IPU to host."]
    opt.state_dict()
    assert messages() == ["Using cached optimiser state dict"]
    model(_X)
    opt.state_dict()
    assert messages() == ["Writing optimiser state tensors from IPU to host."]
    model.detachFromDevice()
    opt.load_state_dict(opt.state_dict())
    messages()
    model.attachToDevice()
    assert messages() == ["Writing optimiser state tensors from host to IPU memory"]


def test_an_offline_model_has_no_ipu_state():
    net = _Net()
    opt = poptorch.optim.SGD(net.parameters(), lr=0.0)
    model = poptorch.trainingModel(net, poptorch.Options().useOfflineIpuTarget(), optimizer=opt)
    model.compile(_X)
    assert opt.state_dict()["ipu_state"] is None
