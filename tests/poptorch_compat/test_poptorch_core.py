"""``poptorch.poptorch_core``: the names PopTorch's C++ extension shows to Python."""
from __future__ import annotations

import logging

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl import errors
from ipuxl.poptorch_compat import poptorch_core
from ipuxl.poptorch_compat.poptorch_core import TestErrorType


def test_the_error_classes_are_poptorchs_and_ipuxls():
    assert poptorch_core.Error is poptorch.Error is errors.PoptorchError
    assert issubclass(poptorch_core.RecoverableError, poptorch_core.Error)
    assert issubclass(poptorch_core.UnrecoverableError, poptorch_core.Error)
    # what ipuxl raises where PopTorch raises a poptorch_core.Error
    for cls in (errors.TraceError, errors.DeviceError, errors.ExecutorError):
        assert issubclass(cls, poptorch_core.Error)


def test_an_untraceable_model_raises_a_poptorch_core_error():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x[x > 0]

    with pytest.raises(poptorch_core.Error, match="data-dependent|dynamic|shape"):
        poptorch.inferenceModel(DataDependent())(torch.randn(4))


@pytest.mark.parametrize("category", list(TestErrorType))
def test_each_test_error_category_raises_with_both_contexts_in_its_text(category):
    with pytest.raises(poptorch_core.Error) as info:
        poptorch_core._throwTestError(category)
    assert "throwTestError::topLevel" in info.value.args[0]
    assert "throwTestError::bottomLevel" in info.value.args[0]
    assert info.value.location.count("throwTestError::bottomLevel") == 1
    assert "throwTestError" not in info.value.message


@pytest.mark.parametrize("category, cls, type_name", [
    (TestErrorType.PoplarRecoverableFullReset, errors.RecoverableError, "poplar_recoverable_runtime_error"),
    (TestErrorType.PoplarUnrecoverable, errors.UnrecoverableError, "poplar_unrecoverable_runtime_error"),
    (TestErrorType.PoplarLinkError, errors.PoptorchError, "poplar_link_error"),
    (TestErrorType.Poptorch, errors.PoptorchError, "poptorch_cpp_error"),
])
def test_test_errors_have_upstreams_class_and_type(category, cls, type_name):
    with pytest.raises(cls) as info:
        poptorch_core._throwTestError(category)
    assert info.value.type == type_name
    if category is TestErrorType.PoplarRecoverableFullReset:
        assert info.value.recovery_action == "FULL_RESET"
    if category is TestErrorType.PoplarLinkError:
        assert "-lfoo not found" in info.value.message  # the linker's output is part of the message


def test_throw_test_error_refuses_an_unknown_category():
    with pytest.raises(ValueError, match="unknown TestErrorType"):
        poptorch_core._throwTestError(99)


def test_validate_options_accepts_every_option_a_program_sets(tmp_path):
    opts = poptorch.Options().outputMode(poptorch.OutputMode.All)
    opts.deviceIterations(2).setExecutionStrategy(poptorch.PipelinedExecution()).replicationFactor(1)
    opts.logDir(str(tmp_path)).enableSyntheticData(True).maxRepeatLogs(None).randomSeed(3)
    opts.TensorLocations.setWeightLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    opts._Popart.set("dotChecks", ["FINAL"])
    opts._Popart.setPatterns({"PadSum": True}, 0)
    poptorch_core._validateOptions(opts.toDict())


@pytest.mark.parametrize("key, value, message", [
    ("notAnOption", True, r"Unknown bool option notAnOption"),
    ("notAnOption", 3, r"Unknown uint64 option notAnOption"),
    ("dotChecks", torch.empty(1, 1), r"Unknown value type .*Tensor.* for option dotChecks"),
])
def test_validate_options_refuses_unknown_options_and_value_types(key, value, message):
    opts = poptorch.Options()
    opts._Popart.set(key, value)
    with pytest.raises(poptorch_core.Error, match=message):
        poptorch_core._validateOptions(opts.toDict())


def test_validate_options_logs_each_option_it_sets(caplog):
    opts = poptorch.Options()
    opts._Popart.set("engineOptions", {"debug.allowOutOfMemory": "true"})
    opts._Popart.set("hardwareInstrumentations", {0, 1})
    opts._Popart.set("enableOutlining", True)
    with caplog.at_level(logging.DEBUG, logger="poptorch:cpp"):
        poptorch_core._validateOptions(opts.toDict())
    lines = [r.getMessage() for r in caplog.records if r.name == "poptorch:cpp"]
    assert "poptorch.Options set engineOptions[debug.allowOutOfMemory] to true" in lines
    assert {"poptorch.Options added 0 to hardwareInstrumentations",
            "poptorch.Options added 1 to hardwareInstrumentations"} <= set(lines)
    assert "poptorch.Options set enableOutlining to value true" in lines
    assert "poptorch.Options set device_iterations to value 1" in lines


def test_is_compiling_with_dispatcher_is_true_only_while_capturing():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(poptorch_core.isCompilingWithDispatcher())
            return x * 2

    model = Probe()
    model(torch.ones(2))
    poptorch.inferenceModel(model)(torch.ones(2))
    assert seen[0] is False and True in seen[1:]
    assert poptorch_core.isCompilingWithDispatcher() is False


def test_propagate_input_shapes_types_a_torchscript_graph():
    graph = torch._C.parse_ir("graph(%x : Tensor):\n"
                              "  %one : int = prim::Constant[value=1]()\n"
                              "  %y : Tensor = aten::add(%x, %x, %one)\n"
                              "  return (%y)")
    example = torch.ones(2, 3)
    for value in graph.inputs():
        value.inferTypeFrom(example)
    poptorch_core.propagateInputShapes(graph)
    output = next(iter(graph.outputs())).type()
    assert output.sizes() == [2, 3]


def test_the_backend_log_level_takes_upstreams_integers():
    loggers = [logging.getLogger("poptorch::python"), logging.getLogger("ipuxl")]
    before = [(lg.level, list(lg.handlers)) for lg in loggers]
    try:
        poptorch_core.setLogLevel(4)
        assert loggers[0].level == logging.ERROR
    finally:  # ipuxl's level too (setLogLevel sets it): later tests of this process read its records
        for lg, (level, handlers) in zip(loggers, before):
            lg.setLevel(level)
            lg.handlers[:] = handlers


def test_names_of_the_cpp_backend_ipuxl_lacks_say_so():
    with pytest.raises(AttributeError, match="compileWithTrace.*C\\+\\+ backend"):
        poptorch_core.compileWithTrace  # noqa: B018 - the attribute access is the test


def test_poptorch_core_is_an_attribute_and_a_module_of_poptorch():
    import ipuxl.compat

    ipuxl.compat.install()
    import poptorch as upstream_name
    import poptorch.poptorch_core as core

    assert core is poptorch_core and upstream_name.poptorch_core is poptorch_core
