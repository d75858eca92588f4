"""PopTorch's hardware queries (``ipuxl.poptorch_compat.hardware``) on a simulated device."""
from __future__ import annotations

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl import errors


def test_the_simulated_ipus_are_the_ipu_hardware(monkeypatch):
    monkeypatch.delenv("IPUXL_NUM_IPUS", raising=False)
    assert poptorch.ipuHardwareIsAvailable() is True
    assert poptorch.ipuHardwareIsAvailable(num_ipus=64) is True
    assert poptorch.ipuHardwareIsAvailable(num_ipus=65) is False
    assert poptorch.ipuHardwareVersion() == 2
    monkeypatch.setenv("IPUXL_NUM_IPUS", "4")
    assert poptorch.ipuHardwareIsAvailable(num_ipus=4) is True
    assert poptorch.ipuHardwareIsAvailable(num_ipus=8) is False
    with pytest.raises(TypeError, match="num_ipus must be an int"):
        poptorch.ipuHardwareIsAvailable("1")
    monkeypatch.setenv("IPUXL_NUM_IPUS", "four")
    with pytest.raises(ValueError, match="IPUXL_NUM_IPUS must be a whole number"):
        poptorch.ipuHardwareIsAvailable()


def test_ipuxl_num_ipus_0_answers_as_a_machine_without_ipus(monkeypatch):
    monkeypatch.setenv("IPUXL_NUM_IPUS", "0")
    assert poptorch.ipuHardwareIsAvailable() is False
    with pytest.raises(AssertionError, match="No IPU hardware available on this system") as info:
        poptorch.ipuHardwareVersion()
    assert isinstance(info.value, errors.NoIpuHardwareError)


def test_is_running_on_ipu_is_true_only_inside_the_captured_forward():
    class TwoPaths(torch.nn.Module):
        def forward(self, x):
            return x * 2 if poptorch.isRunningOnIpu() else x * 3

    model = TwoPaths()
    x = torch.ones(2)
    assert not poptorch.isRunningOnIpu()
    torch.testing.assert_close(model(x), x * 3)
    torch.testing.assert_close(poptorch.inferenceModel(model)(x), x * 2)
