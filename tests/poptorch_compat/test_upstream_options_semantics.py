"""Upstream PopTorch's semantics of ``poptorch.Options`` and of the hints checked at compile time:
the default execution strategy, what wrapping a model does with its options
(``model_options``), ``POPTORCH_DEFAULT_OPTIONS``, assignment, deepcopy of frozen options,
the implicit mean-reduction strategy, ``set_overlap_for_input/output`` and ``MultiConv``
misuse, and too many IPUs (upstream ``tests/options_test.py``, ``batching_test.py``,
``overlapped_io_test.py``, ``multiconv_test.py``, ``optimizers_test.py``,
``replicated_graph_test.py``)."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import DeviceError, FrozenOptionsError, OptionsError, PoptorchError
from ipuxl.poptorch_compat.options import Options, OutputMode

_INFERENCE_ACCUMULATION = (r"You must set poptorch\.Options\(\)\.Training\.gradientAccumulation to 1 or leave it as "
                           r"its default value \(1\) when running a poptorch\.inferenceModel\(\)\.")
_PIPELINED_ADVICE = (r" Use poptorch\.Options\(\)\.deviceIterations to process a sufficient number of batches each "
                     r"run for pipelined execution instead\.")


# -- default strategy and what wrapping a model does with its options -------------------------------------------------
def test_default_execution_strategy_is_a_pipelined_execution():
    strategy = Options()._execution_strategy
    assert isinstance(strategy, poptorch.PipelinedExecution)
    assert not isinstance(strategy, poptorch.ShardedExecution)
    assert Options().execution_strategy is not Options().execution_strategy  # one per Options


def test_inference_refuses_gradient_accumulation_with_upstreams_message():
    from ipuxl.poptorch_compat.model_options import model_options

    opts = Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(PoptorchError, match=_INFERENCE_ACCUMULATION + _PIPELINED_ADVICE):
        model_options(opts, training=False)
    sharded = Options().setExecutionStrategy(poptorch.ShardedExecution())
    sharded.Training.gradientAccumulation(2)
    with pytest.raises(PoptorchError, match=_INFERENCE_ACCUMULATION) as info:
        sharded.check_inference_accumulation()
    assert "pipelined execution" not in str(info.value)
    assert model_options(sharded, training=True).Training.gradient_accumulation == 2  # training takes it


def test_model_options_freezes_the_users_options_and_resolves_the_output_mode_in_a_copy():
    from ipuxl.poptorch_compat.model_options import model_options

    opts = Options()
    training, inference = model_options(opts, training=True), model_options(opts, training=False)
    assert (training.output_mode, inference.output_mode) == (OutputMode.Final, OutputMode.All)
    assert opts.output_mode is OutputMode.Default and opts.frozen
    assert training is not opts and training.frozen and inference.frozen
    with pytest.raises(FrozenOptionsError):
        opts.randomSeed(42)
    explicit = Options().outputMode(OutputMode.Sum)
    assert model_options(explicit, training=False).output_mode is OutputMode.Sum
    assert model_options(None, training=False).output_mode is OutputMode.All
    with pytest.raises(PoptorchError, match="Expected poptorch.Options"):
        model_options({"deviceIterations": 2}, training=True)  # type: ignore[arg-type]


def test_deepcopy_of_frozen_options_is_unfrozen_and_independent():
    opts = Options().deviceIterations(3)
    opts._freeze()
    copied = copy.deepcopy(opts)
    assert not copied.frozen and opts.frozen
    copied.deviceIterations(5).Training.gradientAccumulation(4)
    copied.Distributed.configureProcessId(5, 15)
    copied._Popart.set("autoRecomputation", 3)
    copied.Precision.setPartialsType(torch.float16)
    assert (opts.device_iterations, opts.Training.gradient_accumulation) == (3, 1)
    with pytest.raises(FrozenOptionsError):
        opts.Training.gradientAccumulation(4)


# -- the implicit mean-reduction strategy --------------------------------------------------------------------------
@pytest.mark.parametrize("accum_type, combined, expected", [
    (torch.float16, False, poptorch.MeanReductionStrategy.Running),
    (torch.float16, True, poptorch.MeanReductionStrategy.Post),
    (torch.float32, False, poptorch.MeanReductionStrategy.Post),
])
def test_float16_accumulation_makes_the_mean_reduction_strategy_running(accum_type, combined, expected):
    from ipuxl.poptorch_compat.model_options import model_options

    model = torch.nn.Linear(2, 2)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.01, accum_type=accum_type, use_combined_accum=combined)
    opts = Options()
    resolved = model_options(opts, training=True, optimizer=optimizer)
    assert resolved.Training.meanAccumulationAndReplicationReductionStrategy is expected
    assert opts.Training.meanAccumulationAndReplicationReductionStrategy is poptorch.MeanReductionStrategy.Post
    assert resolved.frozen


def test_a_float16_optimizer_after_compiling_with_post_is_refused():
    from ipuxl.poptorch_compat.model_options import resolve_mean_reduction_strategy

    model = torch.nn.Linear(2, 2)
    opts = Options()
    opts._freeze()
    half = poptorch.optim.Adam(model.parameters(), lr=0.5, accum_type=torch.float16)
    with pytest.raises(ValueError, match="is already compiled"):
        resolve_mean_reduction_strategy(opts, half, compiled=True)
    resolve_mean_reduction_strategy(opts, half, compiled=False)  # before compiling: changed, still frozen
    assert opts.Training.meanAccumulationAndReplicationReductionStrategy is poptorch.MeanReductionStrategy.Running
    assert opts.frozen
    resolve_mean_reduction_strategy(opts, half, compiled=True)  # already Running: accepted


# -- POPTORCH_DEFAULT_OPTIONS --------------------------------------------------------------------------------------
def test_default_options_from_the_environment(monkeypatch, tmp_path):
    expected = Options().deviceIterations(2).replicationFactor(1).logDir(str(tmp_path)).enableSyntheticData(True)
    expected.Precision.enableFloatingPointExceptions(True)
    expected.connectionType(poptorch.ConnectionType.OnDemand)
    expected._Popart.set("saveInitializersToFile", "my_file.onnx")
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", json.dumps({
        "deviceIterations": 2, "replicationFactor": 1, "logDir": str(tmp_path), "enableSyntheticData": True,
        "Precision.enableFloatingPointExceptions": True, "connectionType": "ConnectionType.OnDemand",
        "_Popart.set": ["saveInitializersToFile", "my_file.onnx"]}))
    from_env = Options()
    assert repr(from_env) == repr(expected) and from_env.toDict() == expected.toDict()
    assert from_env.connection_type is poptorch.ConnectionType.OnDemand
    assert "connection_type=ConnectionType.OnDemand" in repr(from_env)  # what differs from upstream's defaults
    monkeypatch.delenv("POPTORCH_DEFAULT_OPTIONS")
    assert Options().device_iterations == 1
    assert repr(from_env) == repr(expected)


@pytest.mark.parametrize("value, fragment", [
    ("{deviceIterations: 2}", "POPTORCH_DEFAULT_OPTIONS is not valid JSON"),
    ('["deviceIterations", 2]', "must hold a JSON object"),
    ('{"noSuchSetter": 2}', "'noSuchSetter' is not a setter of poptorch.Options"),
    ('{"deviceIterations": 0}', "device_iterations must be a positive int"),
])
def test_bad_default_options_from_the_environment_are_refused(monkeypatch, value, fragment):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", value)
    with pytest.raises(OptionsError, match=fragment):
        Options()


# -- attributes ------------------------------------------------------------------------------------------------------
def test_options_can_be_assigned_as_upstream():
    opts = Options()
    opts.replication_factor = 4
    opts.output_mode = OutputMode.Sum
    opts.Precision.half_float_casting = poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat
    opts.log_dir = "logs"
    assert (opts.replication_factor, opts.output_mode, opts.log_dir) == (4, OutputMode.Sum, "logs")
    assert opts.Precision.half_float_casting is poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat
    opts._Popart.set("dummyKey", 5)
    opts._Popart.dummyKey = 6
    assert opts._Popart.options["dummyKey"] == 6
    with pytest.raises(OptionsError, match="Unexpected type str for option dummyKey"):
        opts._Popart.dummyKey = "six"
    with pytest.raises(OptionsError, match="replication_factor must be a positive int"):
        opts.replication_factor = 0
    opts._freeze()
    with pytest.raises(FrozenOptionsError):
        opts.replication_factor = 2


def test_distributed_exposes_upstreams_keys():
    opts = Options()
    opts.Distributed.configureProcessId(2, 15)
    assert (opts.Distributed.distributed_process_id, opts.Distributed.num_distributed_processes) == (2, 15)
    assert opts.Distributed.toDict() == {"distributed_process_id": 2, "num_distributed_processes": 15}


# -- set_overlap_for_input / set_overlap_for_output ----------------------------------------------------------------
_OVERLAP = poptorch.OverlapMode.OverlapAccumulationLoop


def _overlap_options() -> Options:
    opts = Options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.TensorLocations.numIOTiles(32)
    return opts


class _DoubleInputUse(torch.nn.Module):
    def forward(self, x):
        return x + 1, poptorch.set_overlap_for_input(x, _OVERLAP)


class _NotOnInput(torch.nn.Module):
    def forward(self, x):
        y = x + 1
        return y, poptorch.set_overlap_for_input(y, _OVERLAP)


class _DoubleOutputUse(torch.nn.Module):
    def forward(self, x):
        y = x + 1
        return y, poptorch.set_overlap_for_output(y, _OVERLAP)


class _OutputBeforeLoss(torch.nn.Module):
    def forward(self, x):
        x = poptorch.set_overlap_for_input(x, _OVERLAP)
        x = poptorch.set_overlap_for_output(x + torch.ones_like(x), _OVERLAP)
        return torch.mean(x)


@pytest.mark.parametrize("model, fragment", [
    (_DoubleInputUse, r"poptorch\.set_overlap_for_input must be the only op applied to an input\. This is not the "
                      r"case for input x to the model\."),
    (_NotOnInput, r"poptorch\.set_overlap_for_input applied on a node which is not a tensor input to the model\."),
    (_DoubleOutputUse, r"poptorch\.set_overlap_for_output cannot be used with a tensor that is returned twice\. "
                       r"Please check all returned tensors including those nested in tuples/lists\."),
    (_OutputBeforeLoss, r"poptorch\.set_overlap_for_output applied on a node which is not a tensor output to the "
                        r"model\."),
])
def test_overlap_misuse_is_diagnosed_as_upstream(model, fragment):
    with pytest.raises(PoptorchError, match=fragment):
        poptorch.inferenceModel(model(), _overlap_options())(torch.tensor([1.0]))


def test_overlapped_io_needs_sharded_execution_and_io_tiles_and_then_matches_eager():
    class Overlapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            x = poptorch.set_overlap_for_input(x, _OVERLAP)
            out = self.lin(x)
            return poptorch.set_overlap_for_output(out, _OVERLAP), out.sum()

    model, x = Overlapped(), torch.randn(4, 3)
    with pytest.raises(PoptorchError, match=r"Overlapped IO is not supported with poptorch\.PipelinedExecution\. If "
                                            r"you are using only one IPU, please switch to poptorch\.ShardedExecution"):
        poptorch.inferenceModel(model)(x)
    sharded = Options().setExecutionStrategy(poptorch.ShardedExecution())
    with pytest.raises(PoptorchError, match=r"No IO tiles allocated\. You must allocate at least 32 IO tiles using "
                                            r"poptorch\.Options\(\)\.TensorLocations\.numIOTiles\."):
        poptorch.inferenceModel(model, sharded)(x)
    out, total = poptorch.inferenceModel(model, _overlap_options())(x)
    ref_out, ref_total = model(x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(total, ref_total)


# -- MultiConv -------------------------------------------------------------------------------------------------------
def test_nested_or_empty_multi_conv_is_refused_as_upstream():
    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 2, 3)

        def forward(self, x):
            with poptorch.MultiConv():
                with poptorch.MultiConv():
                    return self.conv(x)

    class Empty(torch.nn.Module):
        def forward(self, x):
            with poptorch.MultiConv():
                return torch.pow(x, 2)

    with pytest.raises(RuntimeError, match="Nested poptorch.MultiConv is not supported"):
        poptorch.inferenceModel(Nested())(torch.zeros(2, 1, 8, 8))
    with pytest.raises(RuntimeError, match="Unexpected end_multi_conv"):
        poptorch.inferenceModel(Empty())(torch.ones(2, 2))
    nested = Nested()  # outside a capture too: the scope cannot nest
    with pytest.raises(RuntimeError, match="Nested poptorch.MultiConv is not supported"):
        nested(torch.zeros(2, 1, 8, 8))
    with poptorch.MultiConv():  # and the failed scope left none open
        pass


# -- IPUs ------------------------------------------------------------------------------------------------------------
def test_more_ipus_than_the_machine_has_are_refused(monkeypatch):
    from ipuxl.poptorch_compat.hardware import check_ipu_count

    monkeypatch.setenv("IPUXL_NUM_IPUS", "4")
    check_ipu_count(4)
    opts = Options().replicationFactor(8)
    model = poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)
    with pytest.raises(DeviceError, match=r"Too many IPUs requested \(8\)\. Experiments that need more than 4 IPUs"):
        model(torch.randn(8, 2))
    assert isinstance(DeviceError("x"), PoptorchError)


def test_pipelined_inference_depth_message_is_upstreams():
    class TwoStages(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

        def forward(self, x):
            with poptorch.Block("A", ipu_id=0):
                x = self.a(x)
            with poptorch.Block("B", ipu_id=1):
                return self.b(x)

    with pytest.raises(PoptorchError, match=r"poptorch\.Options\(\)\.deviceIterations must be greater than or equal "
                                            r"to the number of pipeline stages \(2\)"):
        poptorch.inferenceModel(TwoStages())(torch.zeros(1, 1))
