"""Every setter of PopTorch 3.x's ``Options`` and its sub-objects (issue #15, part 2):
each round-trips through ``toDict()`` under upstream's key, refuses bad arguments with
the error type upstream raises, and refuses changes once a model compiled with it."""
from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import ConfigFileError, FrozenOptionsError, OptionsError
from ipuxl.poptorch_compat.enums import (
    CommGroupType, ConnectionType, HalfFloatCastingBehavior, MeanReductionStrategy, ReductionType, SyncPattern,
)
from ipuxl.poptorch_compat.options import Options, OutputMode, TensorLocationSettings

from tests.poptorch_compat._checks import raises_in
from tests.poptorch_compat.runtime.test_executor import MLP, make_data

raises = raises_in(__file__)


class _Strategy:
    """Stands for an execution strategy object (upstream's have ``backendOptions()``)."""

    def backendOptions(self):  # noqa: N802
        return {}


OFF_CHIP = TensorLocationSettings().useOnChipStorage(False).minElementsForOffChip(64)

#: setter path -> (call, {upstream key in toDict(): value after the call})
SETTERS = {
    "deviceIterations": (lambda o: o.deviceIterations(7), {"device_iterations": 7}),
    "replicationFactor": (lambda o: o.replicationFactor(4), {"replication_factor": 4}),
    "inputReplicaGrouping": (lambda o: o.inputReplicaGrouping(2, CommGroupType.Orthogonal),
                             {"input_group_size": 2, "input_cgt": CommGroupType.Orthogonal}),
    "outputMode": (lambda o: o.outputMode(OutputMode.EveryN, 3), {"output_mode": OutputMode.EveryN,
                                                                   "output_return_period": 3}),
    "anchorMode": (lambda o: o.anchorMode(OutputMode.Sum), {"output_mode": OutputMode.Sum}),
    "anchorTensor": (lambda o: o.anchorTensor("g", "Gradient___w", OutputMode.All),
                     {"anchored_tensors": {"g": ["Gradient___w", False, OutputMode.All, 1]}}),
    "randomSeed": (lambda o: o.randomSeed(1234), {"random_seed": 1234}),
    "useIpuModel": (lambda o: o.useIpuModel(True), {"use_model": True}),
    "staticShapes": (lambda o: o.staticShapes(), {"static_shapes": True}),
    "autoOutline": (lambda o: o.autoOutline(False), {"auto_outline": False}),
    "setAvailableMemoryProportion": (lambda o: o.setAvailableMemoryProportion({"IPU0": 0.3, "IPU1": 0.5}),
                                     {"available_memory_proportion": {0: 0.3, 1: 0.5}}),
    "connectionType": (lambda o: o.connectionType(ConnectionType.OnDemand),
                       {"connection_type": ConnectionType.OnDemand}),
    "updatableNamedBuffers": (lambda o: o.updatableNamedBuffers(["bn.running_mean"]),
                              {"updatable_named_buffers": ["bn.running_mean"]}),
    "syncPattern": (lambda o: o.syncPattern(SyncPattern.ReplicaAndLadder),
                    {"sync_pattern": SyncPattern.ReplicaAndLadder}),
    "useIpuId": (lambda o: o.useIpuId(3), {"ipu_id": 3}),
    "useOfflineIpuTarget": (lambda o: o.useOfflineIpuTarget(21), {"ipu_version": 21,
                                                                 "connection_type": ConnectionType.Never}),
    "autoRoundNumIPUs": (lambda o: o.autoRoundNumIPUs(True), {"auto_round_num_ipus": True}),
    "broadcastBuffers": (lambda o: o.broadcastBuffers(False), {"broadcast_buffers": False}),
    "logDir": (lambda o: o.logDir("logs"), {"log_dir": "logs"}),
    "modelName": (lambda o: o.modelName("bert"), {"model_name": "bert"}),
    "enableExecutableCaching": (lambda o: o.enableExecutableCaching("cache"), {"cachePath": "cache",
                                                                               "enableEngineCaching": True}),
    "enableSyntheticData": (lambda o: o.enableSyntheticData(True), {"syntheticDataMode": 2}),
    "enableStableNorm": (lambda o: o.enableStableNorm(True), {"enableStableNorm": True}),
    "logCycleCount": (lambda o: o.logCycleCount(True), {"instrumentWithHardwareCycleCounter": True}),
    "enableProfiling": (lambda o: o.enableProfiling("prof"), {"engineOptions": {
        "debug.allowOutOfMemory": "true", "autoReport.directory": "prof", "autoReport.all": "true"}}),
    "showCompilationProgressBar": (lambda o: o.showCompilationProgressBar(False),
                                   {"show_compilation_progress_bar": False}),
    "relaxOptimizerAttributesChecks": (lambda o: o.relaxOptimizerAttributesChecks(),
                                       {"relax_optimizer_attributes_checks": True}),
    "disableModuleNamescope": (lambda o: o.disableModuleNamescope(), {"module_namescope_enabled": False}),
    "sourceLocationExcludes": (lambda o: o.sourceLocationExcludes(["lib/"]), {"source_location_excludes": ["lib/"]}),
    "appendToLocationExcludes": (lambda o: o.appendToLocationExcludes("a/", "b/"),
                                 {"source_location_excludes": ["a/", "b/"]}),
    "Training.gradientAccumulation": (lambda o: o.Training.gradientAccumulation(5), {"gradient_accumulation": 5}),
    "Training.accumulationAndReplicationReductionType": (
        lambda o: o.Training.accumulationAndReplicationReductionType(ReductionType.Sum),
        {"accumulation_and_replication_reduction_type": ReductionType.Sum}),
    "Training.setMeanAccumulationAndReplicationReductionStrategy": (
        lambda o: o.Training.setMeanAccumulationAndReplicationReductionStrategy(MeanReductionStrategy.Running),
        {"meanAccumulationAndReplicationReductionStrategy": MeanReductionStrategy.Running}),
    "Training.setAutomaticLossScaling": (lambda o: o.Training.setAutomaticLossScaling(True),
                                         {"automaticLossScalingSettings.enabled": True}),
    "Training.setConvolutionDithering": (lambda o: o.Training.setConvolutionDithering(True),
                                         {"convolutionOptions": {"enableConvDithering": True}}),
    "Precision.halfFloatCasting": (lambda o: o.Precision.halfFloatCasting(HalfFloatCastingBehavior.HalfUpcastToFloat),
                                   {"half_float_casting": HalfFloatCastingBehavior.HalfUpcastToFloat}),
    "Precision.runningStatisticsAlwaysFloat": (lambda o: o.Precision.runningStatisticsAlwaysFloat(False),
                                               {"running_statistics_always_float": False}),
    "Precision.enableFloatingPointExceptions": (lambda o: o.Precision.enableFloatingPointExceptions(True),
                                                {"enableFloatingPointChecks": True}),
    "Precision.enableStochasticRounding": (lambda o: o.Precision.enableStochasticRounding(True),
                                           {"enableStochasticRounding": True}),
    "Precision.setPartialsType": (lambda o: o.Precision.setPartialsType(torch.half),
                                  {"partialsTypeMatMuls": "half", "convolutionOptions": {"partialsType": "half"}}),
    "Jit.traceModel": (lambda o: o.Jit.traceModel(False), {"trace_model": False}),
    "Distributed.configureProcessId": (lambda o: o.Distributed.configureProcessId(1, 2),
                                       {"distributed_process_id": 1, "num_distributed_processes": 2}),
    "TensorLocations.numIOTiles": (lambda o: o.TensorLocations.numIOTiles(64), {"numIOTiles": 64}),
    "TensorLocations.setActivationLocation": (lambda o: o.TensorLocations.setActivationLocation(OFF_CHIP),
                                              {"location_activation": {"onChip": 0, "minElementsForOffChip": 64}}),
    "TensorLocations.setWeightLocation": (
        lambda o: o.TensorLocations.setWeightLocation(TensorLocationSettings().useReplicatedTensorSharding()),
        {"location_weight": {"useReplicatedTensorSharding": 1}}),
    "TensorLocations.setOptimizerLocation": (
        lambda o: o.TensorLocations.setOptimizerLocation(
            TensorLocationSettings().useIOTilesToLoad().minElementsForReplicatedTensorSharding(8)),
        {"location_optimizer": {"useIOTilesToLoad": 1, "minElementsForReplicatedTensorSharding": 8}}),
    "TensorLocations.setAccumulatorLocation": (
        lambda o: o.TensorLocations.setAccumulatorLocation(TensorLocationSettings().useIOTilesToStore(False)),
        {"location_accumulator": {"useIOTilesToStore": 0}}),
    "_Popart.set": (lambda o: o._Popart.set("autoRecomputation", 3), {"autoRecomputation": 3}),
    "_Popart.setPatterns": (lambda o: o._Popart.setPatterns({"OpToIdentity": True}, 1),
                            {"patterns": {"OpToIdentity": True}, "patterns_level": 1}),
    "_Popart.setEngineOptions": (lambda o: o._Popart.setEngineOptions({"opt": "1"}), {"engineOptions": {"opt": "1"}}),
}
# setters checked elsewhere in this file: they take a file, an object, or read the environment
OTHER_SETTERS = {"loadFromFile", "setExecutionStrategy", "Distributed.setEnvVarNames", "Distributed.disable", "freeze",
                 "maxRepeatLogs"}  # maxRepeatLogs: a console setting, not in toDict (tests/poptorch_compat)


@pytest.mark.parametrize("name", sorted(SETTERS))
def test_every_setter_round_trips_through_to_dict(name):
    call, expected = SETTERS[name]
    opts = Options()
    before = opts.toDict()
    result = call(opts)
    after = opts.toDict()
    assert result is not None, "setters chain: each returns the object it was called on"
    for key, value in expected.items():
        assert after[key] == value, f"{name}: toDict()[{key!r}] is {after[key]!r}, expected {value!r}"
        assert before.get(key) != value, f"{name}: {key} already had that value"
    assert opts.clone().toDict() == after  # a clone keeps it
    assert pickle.loads(pickle.dumps(opts)).toDict() == after
    assert {k: v for k, v in after.items() if k not in expected} == \
        {k: v for k, v in before.items() if k not in expected}  # nothing else changed


def _public_setters() -> set[str]:
    opts = Options()
    groups = {"": opts, "Training.": opts.Training, "Precision.": opts.Precision, "Jit.": opts.Jit,
              "Distributed.": opts.Distributed, "TensorLocations.": opts.TensorLocations, "_Popart.": opts._Popart}
    found = set()
    for prefix, group in groups.items():
        for name, member in inspect.getmembers(type(group), inspect.isfunction):
            if name[0].islower() and name[0] != "_" and any(c.isupper() for c in name) or name in ("set", "freeze"):
                found.add(prefix + name)
    return {name for name in found if name.rpartition(".")[2] not in ("toDict", "defaultOutputMode")}


def test_the_table_covers_every_public_setter():
    assert _public_setters() - set(SETTERS) - OTHER_SETTERS == set()


def test_values_read_by_key_and_through_properties():
    opts = Options().deviceIterations(3).connectionType(ConnectionType.Never).inputReplicaGrouping(
        2, CommGroupType.Consecutive)
    opts.Precision.setPartialsType(torch.float16)
    assert opts.device_iterations == 3 and opts.log_dir == "." and opts.exists("log_dir")
    assert not opts.exists("random_seed") and opts.randomSeed(5).exists("random_seed")
    assert (opts.connection_type, opts.input_group_size, opts.input_group_type) == (
        ConnectionType.Never, 2, CommGroupType.Consecutive)
    assert opts.Precision.partials_type is torch.float16 and Options().Precision.partials_type is torch.float32
    assert opts.Training.accumulation_and_replication_reduction_type is ReductionType.Mean
    with pytest.raises(AttributeError, match="no option or attribute 'no_such_option'"):
        opts.no_such_option  # noqa: B018


def test_distributed_reads_the_environment_until_disabled(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    opts = Options()
    assert (opts.toDict()["distributed_process_id"], opts.toDict()["num_distributed_processes"]) == (3, 4)
    opts.Distributed.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)
    opts.Distributed.disable()
    assert (opts.toDict()["distributed_process_id"], opts.toDict()["num_distributed_processes"]) == (0, 1)


def test_execution_strategy_is_recorded_and_checked():
    strategy = _Strategy()
    assert Options().setExecutionStrategy(strategy).execution_strategy is strategy
    with raises(OptionsError, "strategy must be an execution strategy"):
        Options().setExecutionStrategy("pipelined")


BAD = [
    (lambda o: o.deviceIterations("4"), AssertionError, "device_iterations must be a positive int"),
    (lambda o: o.inputReplicaGrouping(2, CommGroupType.All), ValueError, "input_group_type must be one of"),
    (lambda o: o.inputReplicaGrouping(0, CommGroupType.Consecutive), ValueError, "input_group_size"),
    (lambda o: o.Training.accumulationAndReplicationReductionType(ReductionType.NoReduction), ValueError,
     "reduction_type must be one of poptorch.ReductionType.Mean, poptorch.ReductionType.Sum"),
    (lambda o: o.Training.setMeanAccumulationAndReplicationReductionStrategy(1), ValueError,
     "must be a MeanReductionStrategy"),
    (lambda o: o.Precision.halfFloatCasting("half"), ValueError, "must be a HalfFloatCastingBehavior"),
    (lambda o: o.Precision.setPartialsType(torch.int32), ValueError, "torch.float or torch.half"),
    (lambda o: o.Precision.runningStatisticsAlwaysFloat(1), ValueError, "must be True or False"),
    (lambda o: o.Precision.enableFloatingPointExceptions("yes"), AssertionError, "must be True or False"),
    (lambda o: o.TensorLocations.numIOTiles(33), AssertionError, "even number between 32 and 192"),
    (lambda o: o.TensorLocations.numIOTiles(256), AssertionError, "even number between 32 and 192"),
    (lambda o: o.TensorLocations.setWeightLocation({"onChip": 0}), AssertionError, "TensorLocationSettings"),
    (lambda o: o.setAvailableMemoryProportion({"GPU0": 0.5}), AssertionError, "keys must be 'IPU<n>'"),
    (lambda o: o.setAvailableMemoryProportion({"IPU0": 1.5}), ValueError, "must be a number in [0, 1]"),
    (lambda o: o.connectionType("Never"), AssertionError, "must be a ConnectionType"),
    (lambda o: o.syncPattern(0), AssertionError, "must be a SyncPattern"),
    (lambda o: o.useIpuId(1.0), AssertionError, "ipu_id must be an int"),
    (lambda o: o.updatableNamedBuffers("bn.running_mean"), ValueError, "list of buffer names"),
    (lambda o: o.anchorTensor("g", "w", OutputMode.EveryN, 0), ValueError, "output_return_period"),
    (lambda o: o.logDir(3), ValueError, "log_dir must be a string"),
    (lambda o: o._Popart.setPatterns(["OpToIdentity"]), AssertionError, "patterns must be a dict"),
    (lambda o: o.randomSeed(-1), ValueError, "random_seed must be in [0, 2**64)"),
]


@pytest.mark.parametrize("call, builtin, fragment", BAD)
def test_bad_arguments_raise_upstreams_error_type_and_change_nothing(call, builtin, fragment):
    opts = Options()
    before = opts.toDict()
    with raises(OptionsError, fragment) as info:
        call(opts)
    assert isinstance(info.value, builtin)
    assert opts.toDict() == before


def test_tensor_location_settings_can_leave_on_chip_undecided():
    settings = TensorLocationSettings().useOnChipStorage(True)
    assert settings.toDict() == {"onChip": 1}
    assert settings.useOnChipStorage(None).toDict() == {}
    assert poptorch.TensorLocationSettings is TensorLocationSettings


def test_partials_and_dithering_share_the_convolution_options():
    opts = Options()
    opts.Precision.setPartialsType(torch.float16)
    opts.Training.setConvolutionDithering(True)
    assert opts._Popart.options["convolutionOptions"] == {"partialsType": "half", "enableConvDithering": True}


def test_executable_caching_none_disables_and_env_var_enables(monkeypatch):
    assert Options().enableExecutableCaching("c").enableExecutableCaching(None).toDict()["enableEngineCaching"] is False
    monkeypatch.setenv("POPTORCH_CACHE_DIR", "/tmp/ipuxl_cache")
    assert Options().toDict()["cachePath"] == "/tmp/ipuxl_cache"


def test_repr_shows_the_core_values_and_what_changed():
    opts = Options().deviceIterations(2).syncPattern(SyncPattern.SinglePipeline)
    opts.Precision.setPartialsType(torch.half)
    text = repr(opts)
    assert text.startswith("Options(device_iterations=2, replication_factor=1, gradient_accumulation=1, ")
    assert "sync_pattern=SyncPattern.SinglePipeline" in text and "partialsTypeMatMuls='half'" in text
    assert "log_dir" not in text and text.endswith("frozen=False)")
    assert repr(opts.Precision) == "_PrecisionOptions()"
    assert repr(opts._Popart).startswith("_PopartOptions(") and "partialsTypeMatMuls='half'" in repr(opts._Popart)


# -- loadFromFile ---------------------------------------------------------------------
def test_load_from_file_applies_one_setter_per_line(tmp_path):
    conf = tmp_path / "poptorch.conf"
    conf.write_text("# options for the run\ndeviceIterations(4)\n\n"
                    "Training.gradientAccumulation(2)\noutputMode(poptorch.OutputMode.All)\n"
                    "Precision.halfFloatCasting(poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat)\n")
    opts = Options().loadFromFile(str(conf))
    expected = Options().deviceIterations(4).outputMode(OutputMode.All)
    expected.Training.gradientAccumulation(2)
    expected.Precision.halfFloatCasting(HalfFloatCastingBehavior.HalfUpcastToFloat)
    assert opts.toDict() == expected.toDict() != Options().toDict()


def test_load_from_file_reports_a_syntax_error_with_its_line(tmp_path):
    conf = tmp_path / "bad.conf"
    conf.write_text("deviceIterations(4)\nreplicationFactor(2\n")
    opts = Options()
    with pytest.raises(ConfigFileError, match=r"line 2 of bad.conf") as info:
        opts.loadFromFile(conf)
    assert info.value.where.endswith("bad.conf:2") and poptorch.ConfigFileError is ConfigFileError


def test_load_from_file_surfaces_a_bad_value_as_the_setter_does(tmp_path):
    conf = tmp_path / "values.conf"
    conf.write_text("deviceIterations(0)\n")
    with pytest.raises(OptionsError, match="device_iterations must be a positive int"):
        Options().loadFromFile(conf)


# -- frozen after use ----------------------------------------------------------------------
def _compiled_options() -> Options:
    torch.manual_seed(0)
    model = MLP()
    opts = Options().deviceIterations(2)
    training = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    training(*make_data(8))
    return opts


@pytest.fixture(scope="module")
def compiled_options():
    return _compiled_options()


@pytest.mark.parametrize("name", sorted(SETTERS))
def test_options_are_frozen_once_a_model_compiled_with_them(compiled_options, name):
    opts = compiled_options
    assert opts.frozen
    before = opts.toDict()
    with raises(FrozenOptionsError, "frozen", "opts.clone()") as info:
        SETTERS[name][0](opts)
    assert isinstance(info.value, AttributeError)  # upstream: AttributeError("Can't modify frozen Options")
    assert opts.toDict() == before
    copy_ = opts.clone()
    SETTERS[name][0](copy_)  # the unfrozen copy takes it
    assert all(copy_.toDict()[k] == v for k, v in SETTERS[name][1].items())


@pytest.mark.parametrize("call, builtin, fragment", BAD)
def test_the_frozen_check_comes_before_argument_checks(compiled_options, call, builtin, fragment):
    with pytest.raises(FrozenOptionsError, match="frozen"):
        call(compiled_options)


def test_frozen_options_refuse_the_file_and_strategy_setters_too(compiled_options, tmp_path):
    conf = tmp_path / "c.conf"
    conf.write_text("logDir('x')\n")
    with pytest.raises(FrozenOptionsError):
        compiled_options.loadFromFile(conf)
    with pytest.raises(FrozenOptionsError):
        compiled_options.setExecutionStrategy(_Strategy())
    with pytest.raises(FrozenOptionsError):
        compiled_options.Distributed.setEnvVarNames("A", "B")


def test_clone_copies_every_sub_object():
    opts = Options()
    opts.Precision.setPartialsType(torch.half)
    opts._Popart.set("k", [1])
    copy_ = opts.clone()
    copy_.Precision.setPartialsType(torch.float)
    copy_._Popart.options["k"].append(2)
    assert opts.Precision.partials_type is torch.float16 and opts._Popart.options["k"] == [1]
    assert copy.deepcopy(opts).toDict() == opts.toDict()
