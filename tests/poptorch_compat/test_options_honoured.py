"""Options that change what a PopTorch model does, against eager PyTorch:
``inputReplicaGrouping``, ``connectionType``/``useOfflineIpuTarget``,
``relaxOptimizerAttributesChecks``, ``Precision.runningStatisticsAlwaysFloat`` and
``Precision.halfFloatCasting``."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl
from ipuxl import Options, OutputMode
from ipuxl.errors import BatchSizeError, DetachedError, OfflineDeviceError, OptionsError, PoptorchError
from ipuxl.poptorch_compat.enums import CommGroupType, ConnectionType, HalfFloatCastingBehavior

from tests.poptorch_compat._checks import raises_in
from tests.poptorch_compat.runtime.test_executor import MLP, make_data

raises = raises_in(__file__)
TOL = dict(rtol=1e-5, atol=1e-6)


# -- inputReplicaGrouping -------------------------------------------------------------------
def _groups(replicas: int, size: int, kind: CommGroupType) -> list[int]:
    """The input slice each replica reads (upstream's CommGroupType layouts)."""
    if kind == CommGroupType.Consecutive:
        return [r // size for r in range(replicas)]
    if kind == CommGroupType.Orthogonal:
        return [r % (replicas // size) for r in range(replicas)]
    return list(range(replicas))


def _grouped(n: int, replicas: int, size: int, kind: CommGroupType) -> Options:
    return (Options().deviceIterations(n).replicationFactor(replicas).inputReplicaGrouping(size, kind)
            .outputMode(OutputMode.All))


GROUPINGS = [(2, 2, CommGroupType.Consecutive), (4, 2, CommGroupType.Consecutive),
             (4, 2, CommGroupType.Orthogonal), (4, 4, CommGroupType.Orthogonal), (4, 1, CommGroupType.NoGrouping)]


@pytest.mark.parametrize("replicas,size,kind", GROUPINGS)
def test_grouped_replicas_train_on_their_group_slice_as_eager(replicas, size, kind):
    """Each step's combined batch holds R / k slices; replica r trains on slice group(r),
    so the averaged gradient is the gradient of the mean loss over the step's slices."""
    torch.manual_seed(0)
    model, n, micro = MLP(), 2, 3
    ref = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, _grouped(n, replicas, size, kind),
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    slices, groups = replicas // size, _groups(replicas, size, kind)
    for call in range(2):
        x, y = make_data(n * slices * micro, seed=call)
        out, losses = training(x, y)
        ref_outs = []
        for xs, ys in zip(x.chunk(n), y.chunk(n)):
            ref_opt.zero_grad()
            step_out, loss = ref(xs, ys)
            loss.backward()
            ref_opt.step()
            ref_outs.append(step_out.detach().reshape(slices, micro, -1)[groups])
        assert out.shape == (n * replicas * micro, 5) and losses.shape == (n * replicas,)
        torch.testing.assert_close(out, torch.stack(ref_outs).reshape(out.shape), **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("kind", [CommGroupType.Consecutive, CommGroupType.Orthogonal])
def test_grouped_inference_returns_every_replica_output(kind):
    torch.manual_seed(1)
    model = MLP()
    n, replicas, size, micro = 3, 4, 2, 2
    inference = ipuxl.inferenceModel(model, _grouped(n, replicas, size, kind))
    x, y = make_data(n * (replicas // size) * micro)
    out, _ = inference(x, y)
    with torch.no_grad():
        ref = model(x, y)[0].reshape(n, replicas // size, micro, -1)[:, _groups(replicas, size, kind)]
    torch.testing.assert_close(out, ref.reshape(out.shape), **TOL)


def test_grouped_input_written_in_place_reaches_the_caller():
    class AddOne(nn.Module):
        def forward(self, x):
            x += 1.0
            return x * 2.0

    n, replicas, size, micro = 2, 4, 2, 3
    inference = ipuxl.inferenceModel(AddOne(), _grouped(n, replicas, size, CommGroupType.Orthogonal))
    x = torch.randn(n * (replicas // size) * micro, 4)
    expected = x + 1.0
    inference(x)
    torch.testing.assert_close(x, expected)


def test_grouped_batch_size_counts_one_slice_per_group():
    model = MLP()
    inference = ipuxl.inferenceModel(model, _grouped(2, 4, 2, CommGroupType.Consecutive))
    x, y = make_data(2 * 4 * 3)  # fine without grouping (8 parts), but 2 x 2 groups = 4 parts
    assert inference(x, y)[0].shape == (2 * 4 * 6, 5)
    x, y = make_data(6)
    with raises(BatchSizeError, "does not split into", "inputReplicaGrouping size 2", "= 4 parts"):
        inference(x, y)


@pytest.mark.parametrize("size,kind,fragment", [(3, CommGroupType.Consecutive, "3 does not divide 4"),
                                                (2, CommGroupType.NoGrouping, "NoGrouping")])
def test_grouping_that_does_not_fit_the_replicas_is_refused(size, kind, fragment):
    inference = ipuxl.inferenceModel(MLP(), _grouped(1, 4, size, kind))
    x, y = make_data(8)
    with raises(OptionsError, f"inputReplicaGrouping({size}, CommGroupType.{kind.name})", fragment,
                "replicationFactor(4)"):
        inference(x, y)


def test_grouping_all_replicas_is_refused_by_the_setter():
    with pytest.raises(ValueError, match="input_group_type"):
        Options().inputReplicaGrouping(2, CommGroupType.All)


# -- connectionType / useOfflineIpuTarget ------------------------------------------------------
@pytest.mark.parametrize("offline", [lambda o: o.connectionType(ConnectionType.Never),
                                     lambda o: o.useOfflineIpuTarget(2)], ids=["Never", "useOfflineIpuTarget"])
def test_offline_device_compiles_but_never_runs_or_attaches(offline):
    model = MLP()
    training = ipuxl.trainingModel(model, offline(Options()), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(4)
    training.compile(x, y)
    assert training.isCompiled() and not training.isAttachedToDevice()
    with raises(OfflineDeviceError, "Trying to run a model on an offline device (ConnectionType.Never)",
                "use model.compile(inputs)") as info:
        training(x, y)
    assert isinstance(info.value, (PoptorchError, AssertionError, DetachedError))
    with raises(OfflineDeviceError, "cannot attach the training model"):
        training.attachToDevice()


@pytest.mark.parametrize("kind", [ConnectionType.Always, ConnectionType.OnDemand])
def test_attached_connection_types_run_as_eager(kind):
    torch.manual_seed(2)
    model = MLP()
    inference = ipuxl.inferenceModel(model, Options().connectionType(kind))
    x, y = make_data(4)
    out, loss = inference(x, y)
    with torch.no_grad():
        ref_out, ref_loss = model(x, y)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert inference.isAttachedToDevice()


# -- relaxOptimizerAttributesChecks --------------------------------------------------------------
def _set_unexpected_optimizer(relax: bool | None, caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    model = MLP()
    opts = Options() if relax is None else Options().relaxOptimizerAttributesChecks(relax)
    training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    training(*make_data(4))
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="poptorch::python"):
        training.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))  # attributes as the first one's
        extra = torch.optim.SGD(model.parameters(), lr=0.05)
        extra.my_attribute = 1
        extra.param_groups[0]["my_group_attribute"] = 2
        training.setOptimizer(extra)
        training.setOptimizer(extra)  # each message once
    return [r for r in caplog.records if r.name == "poptorch::python"]


@pytest.mark.parametrize("relax", [None, False])
def test_unexpected_optimizer_attributes_warn_once(relax, caplog):
    records = _set_unexpected_optimizer(relax, caplog)
    messages = [(r.levelno, r.getMessage()) for r in records]
    assert messages == [
        (logging.WARNING, "Ignoring unexpected optimizer attribute in SGD2 optimizer: ['my_attribute']"),
        (logging.WARNING, "Ignoring unexpected group 0 attribute in SGD2 optimizer: ['my_group_attribute']")]


def test_relaxed_checks_log_unexpected_attributes_at_debug_level(caplog):
    records = _set_unexpected_optimizer(True, caplog)
    assert [r.levelno for r in records] == [logging.DEBUG, logging.DEBUG]
    assert "['my_attribute']" in records[0].getMessage()


# -- Precision.runningStatisticsAlwaysFloat ------------------------------------------------------
class HalfNorm(nn.Module):
    """A float16 batch norm whose updates (momentum 0.01) are below float16's resolution
    near 4.0: kept in float16 the running mean cannot move, in float32 it does."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3, momentum=0.01)

    def forward(self, x):
        y = self.bn(x)
        return y, ipuxl.identity_loss((y.float() ** 2).mean(), reduction="none")


def _train_half_norm(always_float: bool | None, steps: int = 20):
    torch.manual_seed(0)
    x = (torch.randn(8, 3) * 0.3 + 4.1).half()
    model = HalfNorm().half()
    model.bn.running_mean.fill_(4.0)
    opts = Options().deviceIterations(steps)
    if always_float is not None:
        opts.Precision.runningStatisticsAlwaysFloat(always_float)
    training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    training(x.repeat(steps, 1))
    return model, x, training


def _float_statistics(x: torch.Tensor, steps: int, mean: float = 4.0) -> nn.BatchNorm1d:
    ref = nn.BatchNorm1d(3, momentum=0.01)
    ref.running_mean.fill_(mean)
    for _ in range(steps):
        ref(x.float())
    return ref


@pytest.mark.parametrize("always_float", [None, True])
def test_running_statistics_are_kept_in_float32_by_default(always_float):
    model, x, _ = _train_half_norm(always_float)
    ref = _float_statistics(x, 20)
    assert model.bn.running_mean.dtype == torch.float16  # the host module keeps its dtype
    torch.testing.assert_close(model.bn.running_mean, ref.running_mean.half(), rtol=0, atol=0)
    torch.testing.assert_close(model.bn.running_var, ref.running_var.half(), rtol=0, atol=0)
    assert (model.bn.running_mean > 4.0).all()


def test_running_statistics_in_float16_round_every_update():
    """Kept in float16, the statistics update as eager float16 batch norm's (torch's own
    kernel: each step's update rounded to float16, so near 4.0 the mean cannot move)."""
    model, x, _ = _train_half_norm(False)
    eager = nn.BatchNorm1d(3, momentum=0.01).half()
    eager.running_mean.fill_(4.0)
    for _ in range(20):
        eager(x)
    torch.testing.assert_close(model.bn.running_mean, eager.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(model.bn.running_var, eager.running_var, rtol=0, atol=0)
    assert (model.bn.running_mean < _float_statistics(x, 20).running_mean.half()).all()


def test_host_write_to_a_float16_statistic_reaches_its_float32_copy():
    model, x, training = _train_half_norm(True)
    with torch.no_grad():
        model.bn.running_mean.fill_(2.0)
    training(x.repeat(20, 1))
    ref = _float_statistics(x, 20, mean=2.0)
    torch.testing.assert_close(model.bn.running_mean, ref.running_mean.half(), rtol=0, atol=0)


# -- Precision.halfFloatCasting ----------------------------------------------------------------
class Mixed(nn.Module):
    """float16 inputs through float32 weights and a float32 buffer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("scale", torch.tensor([0.5, 2.0, 1.5]))

    def forward(self, x):
        y = self.fc(x) * self.scale
        return y, ipuxl.identity_loss((y.float() ** 2).mean(), reduction="none")


def test_float_downcast_to_half_casts_float32_operands_at_their_use():
    """Weights stay float32 and are updated in float32; ops compute in float16."""
    torch.manual_seed(3)
    model = Mixed()
    ref = copy.deepcopy(model)
    opts = Options().deviceIterations(3).outputMode(OutputMode.All)
    opts.Precision.halfFloatCasting(HalfFloatCastingBehavior.FloatDowncastToHalf)
    training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(6, 4).half()
    out, _ = training(x)
    ref_outs = []
    for xs in x.chunk(3):
        ref_opt.zero_grad()
        y = F.linear(xs, ref.fc.weight.half(), ref.fc.bias.half()) * ref.scale.half()
        (y.float() ** 2).mean().backward()
        ref_opt.step()
        ref_outs.append(y.detach())
    assert out.dtype == torch.float16 and model.fc.weight.dtype == torch.float32
    torch.testing.assert_close(out, torch.cat(ref_outs))
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)
    torch.testing.assert_close(model.fc.bias, ref.fc.bias)


@pytest.mark.parametrize("casting", [None, HalfFloatCastingBehavior.HalfUpcastToFloat])
def test_default_casting_promotes_as_pytorch(casting):
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.tensor([0.1, 3.0, 1.0 / 3.0]))

        def forward(self, x):
            return x * self.scale

    opts = Options()
    if casting is not None:
        opts.Precision.halfFloatCasting(casting)
    model = Scale()
    x = torch.randn(4, 3).half()
    out = ipuxl.inferenceModel(model, opts)(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x * model.scale, rtol=0, atol=0)
