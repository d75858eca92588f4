"""PopTorch's blocks, stages and multi-IPU execution strategies (``poptorch_compat.blocks``).

Eager PyTorch with the same gradient accumulation is the oracle: a pipelined or
sharded model trains exactly as the same model without blocks.
"""
from __future__ import annotations

import copy

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.device.pipeline import pipeline_schedule
from ipuxl.errors import ExecutorError, InvalidArgumentError, OptionsError
from ipuxl.ir.meta import IPU, PIPELINE_STAGE


class ThreeLayers(torch.nn.Module):
    """Three linear layers in blocks "A", "B", "C" (the loss in "C")."""

    def __init__(self, ipus: tuple[int | None, int | None, int | None] = (None, None, None)):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.ipus = ipus
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        with poptorch.Block("A", ipu_id=self.ipus[0]):
            h = torch.relu(self.a(x))
        with poptorch.Block("B", ipu_id=self.ipus[1]):
            h = torch.tanh(self.b(h))
        with poptorch.Block("C", ipu_id=self.ipus[2]):
            out = self.c(h)
            loss = self.loss(out, y)
        return out, loss


def _data(steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


def _eager(model: torch.nn.Module, batches, accumulation: int, lr: float) -> None:
    """Eager PyTorch: one SGD step per combined batch, the mean of its micro-batches' gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(accumulation), y.chunk(accumulation)):
            (model(xs, ys)[1] / accumulation).backward()
        optimizer.step()


def _train(model: torch.nn.Module, strategy, batches, accumulation: int, lr: float) -> poptorch.PoplarExecutor:
    opts = poptorch.Options()
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    opts.Training.gradientAccumulation(accumulation)
    training = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    for x, y in batches:
        training(x, y)
    training.copyWeightsToHost()
    return training


def _three_stages():
    return poptorch.PipelinedExecution(poptorch.Stage("A").ipu(0), poptorch.Stage("B").ipu(1),
                                       poptorch.Stage("C").ipu(2))


@pytest.mark.parametrize("strategy", [
    _three_stages,
    lambda: poptorch.ShardedExecution(poptorch.Stage("A").ipu(0), poptorch.Stage("B", "C").ipu(1)),
    lambda: poptorch.PipelinedExecution("A", "B", "C"),
    lambda: poptorch.SerialPhasedExecution(poptorch.Phase("A"), poptorch.Phase("B"), poptorch.Phase("C")),
    lambda: poptorch.ParallelPhasedExecution(poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("B")).ipus(0, 1),
                                             poptorch.Phase("C").ipus(0)),
], ids=["pipelined", "sharded", "pipelined-by-names", "serial-phased", "parallel-phased"])
def test_split_training_equals_eager(strategy):
    torch.manual_seed(0)
    model = ThreeLayers()
    reference = copy.deepcopy(model)
    batches = _data(steps=3, batch=20)
    training = _train(model, strategy(), batches, accumulation=5, lr=0.1)
    _eager(reference, batches, accumulation=5, lr=0.1)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, msg=name)
    assert training.session is not None


def test_ops_carry_their_blocks_ipu_and_stage():
    torch.manual_seed(0)
    model = ThreeLayers()
    training = _train(model, _three_stages(), _data(1, 10), accumulation=5, lr=0.1)
    program = training._sync.compiled.program
    assert program.stages.ipus == [0, 1, 2] and program.stages.blocks == [["A"], ["B"], ["C"]]
    forward, grad = program.ir.graphs[1], program.ir.graphs[2]
    placed = {n.target: (n.meta[IPU], n.meta[PIPELINE_STAGE]) for n in forward.fx.nodes if IPU in n.meta}
    aten = torch.ops.aten
    assert placed[aten.relu.default] == (0, 0) and placed[aten.tanh.default] == (1, 1)
    assert placed[aten.nll_loss_forward.default] == (2, 2)
    # the backward of forward stage s runs on its IPU in pipeline stage 2 * 3 - 2 - s
    backward = {n.target: (n.meta[IPU], n.meta[PIPELINE_STAGE]) for n in grad.fx.nodes if IPU in n.meta}
    assert backward[aten.nll_loss_backward.default] == (2, 2)
    assert backward[aten.tanh_backward.default] == (1, 3)
    assert backward[aten.threshold_backward.default] == (0, 4)
    assert {v.name: v.node.meta[IPU] for v in program.params.values()} == {
        "a.weight": 0, "a.bias": 0, "b.weight": 1, "b.bias": 1, "c.weight": 2, "c.bias": 2}


def test_report_shows_the_textbook_pipeline_schedule():
    torch.manual_seed(0)
    training = _train(ThreeLayers(), _three_stages(), _data(1, 40), accumulation=8, lr=0.1)
    report = training.report()
    schedule = report.ipus.schedule
    # 3 forward stages make 5 pipeline stages in training, over the 8 accumulated micro-batches
    assert schedule == pipeline_schedule(5, 8)
    assert schedule.cycles[2] == ((0, 2), (1, 1), (2, 0))
    assert report.ipus.stage_ipus == {0: 0, 1: 1, 2: 2, 3: 1, 4: 0}
    assert report.ipus.copies[(0, 1)] > 0 and report.ipus.copies[(1, 0)] > 0
    assert [u.ipu for u in report.ipus.ipus] == [0, 1, 2] and report.ipus.ipus[2].idle_fraction > 0
    assert "Pipeline: 5 stages x 8 micro-batches" in str(report)


def test_the_step_calls_the_stages_in_pipeline_order():
    """Forward stages 0..2 and backward stages 2..4 (stage 2 holds both) over 8 micro-batches:
    the step graph calls the stage graphs in the textbook order of a 5-stage pipeline."""
    torch.manual_seed(0)
    training = _train(ThreeLayers(), _three_stages(), _data(1, 40), accumulation=8, lr=0.1)
    step = next(g for g in training._sync.compiled.program.ir.graphs if g.name.startswith("device_step"))
    called = [(n.meta[PIPELINE_STAGE], n.meta[IPU]) for n in step.fx.nodes if PIPELINE_STAGE in n.meta]
    expected = []
    for stage, _ in pipeline_schedule(5, 8).steps():
        expected += [(stage, [0, 1, 2, 1, 0][stage])] * (2 if stage == 2 else 1)  # stage 2: forward, then backward
    assert called == expected


class WithBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        with poptorch.Block("A"):
            h = torch.relu(self.norm(self.a(x)))
        with poptorch.Block("B"):
            out = self.b(h)
            return out, self.loss(out, y)


def test_pipelined_buffers_update_per_micro_batch_as_eager():
    """Each micro-batch's stage reads the running statistics the previous one wrote."""
    torch.manual_seed(0)
    model = WithBatchNorm()
    reference = copy.deepcopy(model)
    batches = _data(2, 12)
    _train(model, poptorch.PipelinedExecution("A", "B"), batches, accumulation=4, lr=0.1)
    _eager(reference, batches, accumulation=4, lr=0.1)
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)


def test_pipelined_training_needs_enough_accumulation():
    model = ThreeLayers()
    opts = poptorch.Options()
    opts.setExecutionStrategy(_three_stages())
    opts.Training.gradientAccumulation(4)  # 3 forward stages: 5 pipeline stages
    training = poptorch.trainingModel(model, opts)
    x, y = _data(1, 8)[0]
    with pytest.raises(ExecutorError, match=r"gradientAccumulation must be greater than or equal to the number of "
                                            r"pipeline stages \(5\) when using poptorch\.PipelinedExecution\. Please "
                                            r"note that a model with 3 pipeline stages in PopTorch will have an "
                                            r"additional 2 stages when training"):
        training(x, y)
    # sharded execution has no pipeline to fill
    sharded = poptorch.Options()
    sharded.setExecutionStrategy(poptorch.ShardedExecution("A", "B", "C"))
    poptorch.trainingModel(ThreeLayers(), sharded)(x[:2], y[:2])


def test_pipelined_inference_needs_enough_device_iterations():
    model = ThreeLayers()
    opts = poptorch.Options().deviceIterations(2)
    opts.setExecutionStrategy(_three_stages())
    x, y = _data(1, 6)[0]
    with pytest.raises(ExecutorError, match=r"poptorch\.Options\(\)\.deviceIterations must be greater than or equal "
                                            r"to the number of pipeline stages \(3\)"):
        poptorch.inferenceModel(model, opts)(x, y)
    ok = poptorch.Options().deviceIterations(3)
    ok.setExecutionStrategy(_three_stages())
    out, _ = poptorch.inferenceModel(model, ok)(x, y)
    torch.testing.assert_close(out, model.eval()(x, y)[0])


def test_default_strategy_stages_blocks_by_their_ipu():
    """Without a strategy, PopTorch pipelines with AutoStage.SameAsIpu: stage = the block's ipu_id."""
    torch.manual_seed(0)
    model = ThreeLayers(ipus=(0, 1, 1))
    reference = copy.deepcopy(model)
    batches = _data(2, 12)
    training = _train(model, None, batches, accumulation=3, lr=0.05)
    _eager(reference, batches, accumulation=3, lr=0.05)
    assert training._sync.compiled.program.stages.ipus == [0, 1]
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want)


def test_same_as_ipu_without_an_ipu_id_is_refused():
    x, y = _data(1, 3)[0]
    with pytest.raises(OptionsError, match="AutoStage.SameAsIpu was selected but no IPU was specified for block A"):
        poptorch.inferenceModel(ThreeLayers(), poptorch.Options().deviceIterations(3))(x, y)


def test_unknown_block_is_refused():
    opts = poptorch.Options().deviceIterations(2)
    opts.setExecutionStrategy(poptorch.PipelinedExecution("A", "B"))
    x, y = _data(1, 4)[0]
    with pytest.raises(OptionsError, match=r"Unknown Block 'C' list of expected Blocks: \['A', 'B'\]"):
        poptorch.inferenceModel(ThreeLayers(), opts)(x, y)


def test_a_stage_reading_a_later_stage_is_refused():
    opts = poptorch.Options().deviceIterations(3)
    opts.setExecutionStrategy(poptorch.PipelinedExecution("C", "B", "A"))  # stages in the wrong order
    x, y = _data(1, 3)[0]
    with pytest.raises(OptionsError, match="consumed in an earlier pipeline stage"):
        poptorch.inferenceModel(ThreeLayers(), opts)(x, y)


class BeginBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = poptorch.BeginBlock(torch.nn.Linear(8, 4), ipu_id=1)
        self.loss = torch.nn.MSELoss()

    @poptorch.BlockFunction("first", ipu_id=0)
    def first(self, x):
        return torch.sigmoid(self.a(x))

    def forward(self, x, y):
        out = self.b(self.first(x))
        return out, self.loss(out, y)  # after b's BeginBlock: the loss runs on IPU 1 too


def test_begin_block_and_block_function():
    torch.manual_seed(0)
    model = BeginBlocks()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(9, 6, generator=g), torch.randn(9, 4, generator=g)) for _ in range(2)]
    training = _train(model, poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement), batches, 3, 0.1)
    _eager(reference, batches, accumulation=3, lr=0.1)
    program = training._sync.compiled.program
    assert program.stages.ipus == [0, 1] and program.stages.blocks == [["first"], ["0"]]
    loss = next(n for n in program.ir.graphs[1].fx.nodes if n.target is torch.ops.aten.mse_loss.default)
    assert loss.meta[IPU] == 1
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want)


def test_blocks_do_nothing_eagerly_and_remove_blocks():
    layer = torch.nn.Linear(2, 2)
    assert poptorch.BeginBlock(layer, "L", ipu_id=1) is layer
    with pytest.raises(InvalidArgumentError, match="module has already been assigned to a block"):
        poptorch.BeginBlock(layer)
    poptorch.removeBlocks(layer)
    assert not layer._forward_pre_hooks
    x = torch.randn(3, 2)
    with poptorch.Block("eager", ipu_id=3):
        torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)
    assert isinstance(poptorch.BeginBlock(lambda t: t * 2), torch.nn.Module)
    with pytest.raises(InvalidArgumentError, match="not an instance of torch.nn.Module"):
        poptorch.BeginBlock(3)


def test_strategy_objects_follow_upstream():
    stage = poptorch.Stage("A", "B").ipu(1)
    assert stage.blocks == ("A", "B") and stage._ipu == 1
    pipelined = poptorch.PipelinedExecution(stage, "C", ["D", "E"])
    assert pipelined.stage("E").blocks == ("D", "E") and pipelined.stage("E")._stage_id == 2
    assert pipelined.backendOptions() == {"execution_mode": 0}
    assert poptorch.ShardedExecution().backendOptions() == {"execution_mode": 1}
    serial = poptorch.SerialPhasedExecution(poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("B")),
                                            ["C"]).setTensorsLiveness(poptorch.Liveness.OffChipAfterEachPhase)
    serial.phase(0).ipus(0, 1)
    assert serial.phase(0).stage(1)._ipu == 1 and serial.stage("C")._phase_id == 1
    assert serial.backendOptions() == {"execution_mode": 2, "separate_backward_phase": False,
                                       "tensors_liveness": 3, "serial_phases_execution": True}
    parallel = poptorch.ParallelPhasedExecution(["A"], ["B"]).sendTensorsOffChipAfterFwd()
    assert parallel.backendOptions()["tensors_liveness"] == poptorch.Liveness.OffChipAfterFwd.value
    opts = poptorch.Options().setExecutionStrategy(pipelined)
    assert opts.clone().execution_strategy.stage("A")._ipu == 1
    with pytest.raises(OptionsError, match="supposed to be strings"):
        poptorch.Stage(1)
    with pytest.raises(OptionsError, match="A associated with more than one stage"):
        poptorch.PipelinedExecution("A", poptorch.Stage("A", "B"))
    with pytest.raises(OptionsError, match="Phase contains 2 stages but you provided 1 ipus"):
        serial.phase(0).ipus(0)
    with pytest.raises(OptionsError, match="no AutoStage for PhasedExecution"):
        poptorch.SerialPhasedExecution()


def test_tensor_locations_and_popart_options_are_recorded():
    opts = poptorch.Options()
    opts._Popart.set("defaultPrefetchBufferingDepth", 3)
    opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    opts.TensorLocations.setActivationLocation(poptorch.TensorLocationSettings().useOnChipStorage(True))
    shown = opts.toDict()
    assert shown["defaultPrefetchBufferingDepth"] == 3
    assert shown["location_optimizer"] == {"onChip": 0} and shown["location_activation"] == {"onChip": 1}


class WithDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 16), torch.nn.Linear(16, 4)
        self.drop = torch.nn.Dropout(0.5)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        poptorch.Block.start("A")
        h = self.drop(torch.relu(self.a(x)))
        poptorch.Block.start("B")
        out = self.b(self.drop(h))
        return out, self.loss(out, y)


@pytest.mark.parametrize("replicas", [1, 2])
def test_pipeline_order_draws_the_same_dropout_masks_as_one_micro_batch_after_another(replicas):
    """The pipelined step (stages in pipeline order) and the sharded one (micro-batches in
    turn) give each micro-batch the same seeds: same weights, also with replicas."""
    torch.manual_seed(0)
    models = [WithDropout(), None]
    models[1] = copy.deepcopy(models[0])
    batches = _data(2, 6 * replicas)
    stage_graphs = []
    for model, strategy in zip(models, [poptorch.PipelinedExecution("A", "B"), poptorch.ShardedExecution("A", "B")]):
        opts = poptorch.Options().randomSeed(5).replicationFactor(replicas)
        opts.setExecutionStrategy(strategy)
        opts.Training.gradientAccumulation(3)
        training = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in batches:
            training(x, y)
        training.copyWeightsToHost()
        stage_graphs.append(sum("_stage" in g.name for g in training._sync.compiled.program.ir.graphs))
    assert stage_graphs == [4, 0]  # forward stages 0, 1 and backward stages 1, 2; sharded: no split
    for got, want in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_pipelined_inference_runs_the_device_iterations_through_the_stages_in_pipeline_order(replicas):
    """Inference with PipelinedExecution: one step runs the 5 device iterations' micro-batches
    through the 3 stages in the textbook order; outputs equal eager inference, batch by batch."""
    torch.manual_seed(0)
    model = ThreeLayers()
    opts = poptorch.Options().deviceIterations(5)
    opts.replicationFactor(replicas)
    opts.setExecutionStrategy(_three_stages())
    opts.outputMode(poptorch.OutputMode.All)
    x, y = _data(1, 5 * replicas * 4, seed=3)[0]
    inference = poptorch.inferenceModel(model, opts)
    for _ in range(2):  # a second run goes through the same pipeline
        out, loss = inference(x, y)
    expected = [model.eval()(xs, ys) for xs, ys in zip(x.chunk(5 * replicas), y.chunk(5 * replicas))]
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]))
    torch.testing.assert_close(loss, torch.stack([e[1] for e in expected]))
    program = inference._sync.compiled.program
    step = next(g for g in program.ir.graphs if g.name.startswith("device_step"))
    called = [(n.meta[PIPELINE_STAGE], n.meta[IPU]) for n in step.fx.nodes if PIPELINE_STAGE in n.meta]
    assert called == [(stage, stage) for stage, _ in pipeline_schedule(3, 5).steps()]
    report = inference.report()
    assert report.ipus is not None and report.ipus.schedule == pipeline_schedule(3, 5)
    assert all(u.flops > 0 and u.code_ops > 0 for u in report.ipus.ipus)  # each IPU runs its own stage


def test_pipelined_inference_with_a_buffer_update_runs_the_iterations_in_turn():
    """A model that updates buffers in inference (BatchNorm in train mode is not used by
    inferenceModel; a mutated input is) falls back to one iteration after another."""
    torch.manual_seed(0)

    class Counting(ThreeLayers):
        def forward(self, x, y):
            out, loss = super().forward(x, y)
            x.add_(1.0)
            return out, loss

    model = Counting()
    opts = poptorch.Options().deviceIterations(3)
    opts.setExecutionStrategy(_three_stages())
    opts.outputMode(poptorch.OutputMode.All)
    x, y = _data(1, 12, seed=4)[0]
    x_eager = x.clone()
    out, _ = poptorch.inferenceModel(model, opts)(x, y)
    expected = torch.cat([ThreeLayers.forward(model.eval(), xs, ys)[0] for xs, ys in zip(x_eager.chunk(3), y.chunk(3))])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x, x_eager + 1.0)
