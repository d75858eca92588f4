"""PopTorch's enums, error classes, logging and hardware queries (issue #15, part 1).

Upstream's ``python/enums.py`` (PopTorch 3.x) is the contract for member names and
values; ``poptorch.Error`` must catch what PopTorch's ``poptorch.Error`` catches (compile
and device errors), with upstream's ``type``/``message``/``location`` attributes.
"""
from __future__ import annotations

import enum
import logging

import pytest
import torch
import torch.nn as nn

import ipuxl.poptorch_compat as poptorch
from ipuxl import errors
from ipuxl.poptorch_compat import enums

from tests.poptorch_frontend.test_training import MLP, make_data

# upstream's members and values, enum by enum (PopTorch 3.x python/enums.py)
UPSTREAM = {
    "MeanReductionStrategy": {"Running": 0, "Post": 1, "PostAndLoss": 2},
    "DataLoaderMode": {"Sync": 0, "Async": 1, "AsyncRebatched": 2},
    "SharingStrategy": {"SharedMemory": 0, "FileSystem": 1, "Fork": 2, "ForkServer": 3},
    "OutputMode": {"Final": 0, "EveryN": 1, "All": 2, "Sum": 3, "Default": 4},
    "ConnectionType": {"Always": 0, "OnDemand": 1, "Never": 2},
    "HalfFloatCastingBehavior": {"FloatDowncastToHalf": 0, "HalfUpcastToFloat": 1, "Default": 2},
    "ReductionType": {"Sum": 0, "Mean": 1, "NoReduction": 2},
    "SyncPattern": {"Full": 0, "SinglePipeline": 1, "ReplicaAndLadder": 2},
    "MatMulSerializationMode": {"InputChannels": "input_channels", "ReducingDim": "reducing_dim",
                                "OutputChannels": "output_channels", "Disabled": "none"},
    "Liveness": {"AlwaysLive": 0, "OffChipAfterFwd": 1, "OffChipAfterFwdNoOverlap": 2, "OffChipAfterEachPhase": 3},
    "OverlapMode": {"NoOverlap": "no_overlap", "OverlapAccumulationLoop": "overlap_accumulation_loop",
                    "OverlapDeviceIterationLoop": "overlap_device_iteration_loop"},
    "AutoStage": {"SameAsIpu": 0, "AutoIncrement": 1},
    "MultiConvPlanType": {"Parallel": 0, "Serial": 1},
    "CommGroupType": {"All": 0, "Consecutive": 1, "Orthogonal": 2, "NoGrouping": 3},
    "VariableRetrievalMode": {"OnePerGroup": 0, "AllReplicas": 2},
}


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_every_upstream_enum_has_upstreams_members_and_values(name):
    cls = getattr(enums, name)
    assert {m.name: m.value for m in cls} == UPSTREAM[name]
    assert getattr(poptorch, name) is cls  # exported at PopTorch's top level too
    assert name in enums.__all__


def test_int_enums_compare_as_ints_and_string_enums_as_strings():
    assert enums.ReductionType.Mean == 1 and isinstance(enums.ReductionType.Mean, int)
    assert enums.MatMulSerializationMode("reducing_dim") is enums.MatMulSerializationMode.ReducingDim
    assert not issubclass(enums.OverlapMode, int) and issubclass(enums.OverlapMode, enum.Enum)


def test_output_mode_and_data_loader_mode_are_the_ones_the_front_end_uses():
    from ipuxl.poptorch_compat.dataloader import DataLoaderMode
    from ipuxl.poptorch_compat.options import AnchorMode, OutputMode

    assert enums.OutputMode is OutputMode and enums.AnchorMode is AnchorMode is OutputMode
    assert enums.DataLoaderMode is DataLoaderMode is poptorch.DataLoaderMode
    from ipuxl.poptorch_compat.enums import OutputMode as Imported  # ``from poptorch.enums import ...``
    assert Imported is OutputMode
    with pytest.raises(AttributeError, match="poptorch.enums"):
        enums.NotAnEnum  # noqa: B018


# -- errors -----------------------------------------------------------------------------
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
    assert "test_enums_and_errors.py" in error.location


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


# -- logging ----------------------------------------------------------------------------------
@pytest.fixture
def restore_level():
    logger = logging.getLogger("poptorch::python")
    level = logger.level
    yield logger
    logger.setLevel(level)


@pytest.mark.parametrize("name, level", [("TRACE", logging.DEBUG), ("DEBUG", logging.DEBUG),
                                         ("INFO", logging.INFO), ("WARN", logging.WARNING),
                                         ("ERR", logging.ERROR), ("OFF", logging.CRITICAL)])
def test_set_log_level_sets_the_poptorch_logger(restore_level, name, level):
    poptorch.setLogLevel(name)
    assert poptorch.logger is restore_level and restore_level.level == level
    assert poptorch.logging.logger is poptorch.logger and poptorch.logging.setLogLevel is poptorch.setLogLevel


def test_set_log_level_takes_upstreams_legacy_integers(restore_level):
    poptorch.setLogLevel(4)
    assert restore_level.level == logging.ERROR
    poptorch.setLogLevel(2)
    assert restore_level.level == logging.INFO


@pytest.mark.parametrize("bad, fragment", [("LOUD", "unknown log level 'LOUD'"), (5, "invalid log level integer 5"),
                                           (None, "unknown log level None")])
def test_set_log_level_refuses_unknown_levels_with_a_value_error(restore_level, bad, fragment):
    before = restore_level.level
    with pytest.raises(ValueError, match=fragment) as info:
        poptorch.setLogLevel(bad)
    assert "'WARN'" in info.value.fix and restore_level.level == before


def test_log_level_is_read_from_the_environment_at_import(tmp_path):
    import subprocess
    import sys

    code = ("import logging, ipuxl.poptorch_compat as p; "
            "print(p.logger.level, logging.getLogger('poptorch::python').level)")
    env_level = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                               env={**__import__("os").environ, "POPTORCH_LOG_LEVEL": "DEBUG"})
    assert env_level.returncode == 0, env_level.stderr
    assert env_level.stdout.split() == [str(logging.DEBUG)] * 2


# -- hardware ----------------------------------------------------------------------------------
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
