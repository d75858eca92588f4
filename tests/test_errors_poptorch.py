"""PopTorch's error classes in the ``ipuxl.errors`` family.

``poptorch.Error`` must catch what PopTorch's ``poptorch.Error`` catches (compile and device
errors), with upstream's ``type``/``message``/``location`` attributes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ipuxl.poptorch_compat as poptorch
from ipuxl import errors
from ipuxl.poptorch_compat import enums
from tests.poptorch_compat.runtime.test_executor import MLP, make_data


def test_error_classes_form_upstreams_hierarchy_in_the_ipuxl_family():
    assert poptorch.Error is errors.PoptorchError is errors.Error
    assert issubclass(poptorch.RecoverableError, poptorch.Error)
    assert issubclass(poptorch.UnrecoverableError, poptorch.Error)
    assert issubclass(poptorch.Error, errors.IpuxlError)
    assert not issubclass(poptorch.RecoverableError, poptorch.UnrecoverableError)


def test_recoverable_error_carries_upstreams_attributes():
    with pytest.raises(poptorch.Error) as info:
        raise poptorch.RecoverableError("link down", recovery_action="IPU_RESET", where="model.py:3")
    error = info.value
    assert isinstance(error, poptorch.RecoverableError)
    assert (error.recovery_action, error.message, error.location) == ("IPU_RESET", "link down", "model.py:3")
    assert error.type == "poplar_recoverable_runtime_error"
    assert poptorch.UnrecoverableError("gone").type == "poplar_unrecoverable_runtime_error"
    with pytest.raises(errors.InvalidValueError, match="recovery_action must be one of"):
        poptorch.RecoverableError("x", recovery_action="REBOOT")


def test_a_trace_error_is_a_poptorch_error_with_its_location():
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)  # a training model without a loss

    model = NoLoss()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error) as info:
        training(torch.randn(2, 4))
    error = info.value
    assert isinstance(error, errors.TraceError) and isinstance(error, RuntimeError)
    assert error.type == "poptorch_py_error" and error.message and error.message in str(error)
    assert "test_errors_poptorch.py" in error.location


def test_a_device_error_is_a_poptorch_error():
    torch.manual_seed(3)
    model = MLP()
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(2),
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(8)
    y[5] = 99  # a label out of range in step 2
    with pytest.raises(poptorch.Error) as info:
        training(x, y)
    assert isinstance(info.value, errors.DeviceError) and info.value.type == "poplar_runtime_error"
    assert info.value.message in str(info.value) and info.value.steps_applied == 1


def test_options_errors_are_both_value_and_assertion_errors_as_upstreams_checks():
    opts = poptorch.Options()
    with pytest.raises(ValueError):
        opts.deviceIterations(0)
    with pytest.raises(AssertionError):
        opts.deviceIterations("4")
    with pytest.raises(ValueError):
        opts.Training.accumulationAndReplicationReductionType(enums.ReductionType.NoReduction)
