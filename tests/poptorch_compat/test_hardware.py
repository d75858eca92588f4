"""PopTorch's hardware queries (``ipuxl.poptorch_compat.hardware``) on a simulated device."""
from __future__ import annotations

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl import errors


def test_there_is_no_ipu_hardware_on_a_simulated_device():
    assert poptorch.ipuHardwareIsAvailable() is False
    assert poptorch.ipuHardwareIsAvailable(num_ipus=4) is False
    with pytest.raises(AssertionError, match="No IPU hardware available on this system") as info:
        poptorch.ipuHardwareVersion()
    assert isinstance(info.value, errors.NoIpuHardwareError)
    with pytest.raises(TypeError, match="num_ipus must be an int"):
        poptorch.ipuHardwareIsAvailable("1")


def test_is_running_on_ipu_is_true_only_inside_the_captured_forward():
    class TwoPaths(torch.nn.Module):
        def forward(self, x):
            return x * 2 if poptorch.isRunningOnIpu() else x * 3

    model = TwoPaths()
    x = torch.ones(2)
    assert not poptorch.isRunningOnIpu()
    torch.testing.assert_close(model(x), x * 3)
    torch.testing.assert_close(poptorch.inferenceModel(model)(x), x * 2)
