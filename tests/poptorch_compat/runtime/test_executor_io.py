"""What goes in and comes out of a PopTorch-style model: scalar (0-d) outputs and
inputs, and the dtypes of inputs and outputs (bool, integers, float16, bfloat16),
against eager PyTorch."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from ipuxl.errors import BatchSizeError
from ipuxl.poptorch_compat.compile import batching
from ipuxl.poptorch_compat.runtime.executor import inferenceModel, trainingModel
from ipuxl.poptorch_compat.options import Options, OutputMode
from tests.poptorch_compat._checks import as_poptorch
from tests.poptorch_compat._checks import raises_in

raises = raises_in(__file__)


class Reductions(nn.Module):
    """Scalar results of three dtypes, and a batched one."""

    def forward(self, x: torch.Tensor):
        return x.sum(), torch.var(x), (x > 0).all(), x * 2


def opts(mode: OutputMode, iterations: int = 1, period: int = 1) -> Options:
    options = Options().deviceIterations(iterations)
    return options.outputMode(mode, period) if mode == OutputMode.EveryN else options.outputMode(mode)


def micro_batches(x: torch.Tensor, iterations: int) -> list[torch.Tensor]:
    return list(x.reshape(iterations, -1, *x.shape[1:]))


# -- scalar outputs ----------------------------------------------------------------------
@pytest.mark.parametrize("mode", [OutputMode.All, OutputMode.Final, OutputMode.Sum, OutputMode.EveryN])
def test_scalar_outputs_are_0d_with_one_iteration(mode):
    x = torch.randn(4, 3)
    outs = inferenceModel(Reductions(), opts(mode))(x)
    for out, ref in zip(outs, Reductions()(x)):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert_close(out, ref)


@pytest.mark.parametrize("mode, period", [(OutputMode.All, 1), (OutputMode.EveryN, 2)])
def test_scalar_outputs_of_every_step_are_a_vector(mode, period):
    x = torch.randn(12, 3)
    outs = inferenceModel(Reductions(), opts(mode, 4, period))(x)
    steps = [Reductions()(m) for m in micro_batches(x, 4)][period - 1::period]
    for k in range(3):
        expected = torch.stack([s[k] for s in steps])
        assert outs[k].shape == (4 // period,) and outs[k].dtype == expected.dtype
        assert_close(outs[k], expected)
    assert_close(outs[3], torch.cat([s[3] for s in steps]))


def test_every_n_with_one_returned_step_keeps_the_scalar_0d():
    x = torch.randn(4, 3)
    outs = inferenceModel(Reductions(), opts(OutputMode.EveryN, 2, 2))(x)
    last = Reductions()(x[2:])
    assert outs[0].shape == () and outs[3].shape == (2, 3)
    assert_close(outs[0], last[0])


def test_final_and_sum_over_iterations_keep_the_dtype():
    x = torch.randn(6, 3)
    steps = [Reductions()(m) for m in micro_batches(x, 3)]
    final = inferenceModel(Reductions(), opts(OutputMode.Final, 3))(x)
    for out, ref in zip(final, steps[-1]):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert_close(out, ref)
    total = inferenceModel(Reductions(), opts(OutputMode.Sum, 3))(x)
    assert_close(total[0], sum(s[0] for s in steps))
    assert total[2].dtype == torch.bool and total[2].shape == ()
    assert bool(total[2]) == any(bool(s[2]) for s in steps)


def test_final_mode_brings_back_only_the_last_micro_batch(monkeypatch):
    """The other micro-batches' outputs stay on the device: the host copies one step's worth
    (a language model's logits are tens of MiB a step), and the values are the last step's."""
    copied = []
    real = batching.host_tensors
    monkeypatch.setattr(batching, "host_tensors", lambda ts: copied.extend(t.numel() for t in ts) or real(ts))
    x = torch.randn(4 * 5, 3)
    model = nn.Linear(3, 7)
    out = inferenceModel(model, opts(OutputMode.Final, 4))(x)
    assert copied == [5 * 7]
    assert_close(out, model(x[-5:]))
    copied.clear()
    every = inferenceModel(model, opts(OutputMode.All, 4))(x)
    assert copied == [4 * 5 * 7]
    assert_close(every, model(x))


class IntSum(nn.Module):
    def forward(self, x: torch.Tensor):
        return x.sum(dtype=torch.int32), x.to(torch.int16)


def test_sum_mode_keeps_integer_dtypes():
    x = torch.randint(-5, 5, (6, 2), dtype=torch.int32)
    out = inferenceModel(IntSum(), opts(OutputMode.Sum, 3))(x)
    expected = [IntSum()(m) for m in micro_batches(x, 3)]
    assert out[0].dtype == torch.int32 and out[1].dtype == torch.int16
    assert_close(out[0], sum(e[0] for e in expected).to(torch.int32))
    assert_close(out[1], sum(e[1] for e in expected).to(torch.int16))


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, x, y, scale=None):
        out = self.fc(x)
        if scale is not None:
            out = out * scale
        return out, nn.functional.mse_loss(out, y)


def test_training_loss_is_0d_for_one_step_and_a_vector_for_several():
    torch.manual_seed(0)
    model = Regression()
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    eager = copy.deepcopy(model)
    expected = eager(x, y)[1]
    one = trainingModel(model, Options().outputMode(OutputMode.All),
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    _, loss = one(x, y)
    assert loss.shape == () and loss.dtype == expected.dtype
    assert_close(loss, expected)
    one.destroy()
    options = Options().outputMode(OutputMode.All)
    options.Training.gradientAccumulation(2)
    several = trainingModel(model, options, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    _, losses = several(x, y)
    assert losses.shape == (2,)
    assert_close(losses, torch.stack([eager(x[:2], y[:2])[1], eager(x[2:], y[2:])[1]]))


# -- scalar inputs -----------------------------------------------------------------------
def test_scalar_input_is_fed_as_is_without_device_iterations():
    torch.manual_seed(0)
    model = Regression()
    x, y, scale = torch.randn(4, 3), torch.randn(4, 1), torch.tensor(3.0)
    out, loss = inferenceModel(model)(x, y, scale)
    expected = model(x, y, scale)
    assert_close(out, expected[0])
    assert_close(loss, expected[1])


def test_scalar_input_in_training_matches_eager_steps():
    torch.manual_seed(0)
    model = Regression()
    eager = copy.deepcopy(model)
    x, y, scale = torch.randn(4, 3), torch.randn(4, 1), torch.tensor(0.5)
    training = trainingModel(model, Options(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    reference = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(3):
        _, loss = training(x, y, scale)
        reference.zero_grad()
        expected = eager(x, y, scale)[1]
        expected.backward()
        reference.step()
        assert_close(loss, expected.detach())
    training.copyWeightsToHost()
    assert_close(model.fc.weight.detach(), eager.fc.weight.detach())


def test_scalar_input_with_several_iterations_is_refused():
    model = inferenceModel(Regression(), Options().deviceIterations(2))
    with raises(BatchSizeError, "scalar", "deviceIterations 2", "= 2 parts") as info:
        model(torch.randn(4, 3), torch.randn(4, 1), torch.tensor(2.0))
    assert "expand(2)" in info.value.fix


# -- dtypes through the streams ------------------------------------------------------------
class Mixed(nn.Module):
    def forward(self, mask, ids, x):
        return mask & (ids > 1), ids + 1, x * 2, x.sum(), mask


@pytest.mark.parametrize("int_dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("float_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_inputs_and_outputs_keep_torch_dtypes(int_dtype, float_dtype):
    mask = torch.tensor([[True, False, True], [False, True, True]])
    ids = torch.tensor([[1, 2, 3], [4, 0, 2]], dtype=int_dtype)
    x = torch.randn(2, 3).to(float_dtype)
    outs = inferenceModel(Mixed())(mask, ids, x)
    for out, ref in zip(outs, Mixed()(mask, ids, x)):
        ref = as_poptorch(ref)  # int64 comes back int32, as from PopTorch
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert_close(out, ref)


def test_bool_and_int_inputs_over_device_iterations():
    mask = torch.rand(6, 3) > 0.5
    ids = torch.randint(0, 4, (6, 3))
    x = torch.randn(6, 3)
    outs = inferenceModel(Mixed(), Options().deviceIterations(3))(mask, ids, x)
    steps = [Mixed()(*parts) for parts in zip(*(micro_batches(t, 3) for t in (mask, ids, x)))]
    assert_close(outs[0], torch.cat([s[0] for s in steps]))
    assert outs[3].shape == (3,)
    assert_close(outs[3], torch.stack([s[3] for s in steps]))


class HalfClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.fc(x)
        return out, self.loss(out, labels)


def test_half_model_trains_as_eager_half():
    torch.manual_seed(0)
    model = HalfClassifier().half()
    eager = copy.deepcopy(model)
    x, labels = torch.randn(8, 4).half(), torch.randint(0, 3, (8,))
    training = trainingModel(model, Options().deviceIterations(2),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    reference = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(2):
        out, loss = training(x, labels)
        assert out.dtype == torch.float16 and out.shape == (4, 3)
        assert loss.dtype == torch.float16 and loss.shape == ()
        for half in (slice(0, 4), slice(4, 8)):
            reference.zero_grad()
            expected = eager(x[half], labels[half])
            expected[1].backward()
            reference.step()
        assert_close(out, expected[0].detach(), rtol=1e-2, atol=1e-2)
        assert_close(loss, expected[1].detach(), rtol=1e-2, atol=1e-2)
    training.copyWeightsToHost()
    assert model.fc.weight.dtype == torch.float16
    assert_close(model.fc.weight.detach(), eager.fc.weight.detach(), rtol=1e-2, atol=1e-2)


def test_int64_results_come_back_int32_as_from_poptorch():
    """Upstream's bool_support test: ``torch.sum(x == y)`` is int64 in torch, int32 from PopTorch."""
    class CountEqual(nn.Module):
        def forward(self, x, y):
            return torch.sum(x == y), torch.argmax(x, -1)

    x, y = torch.tensor([[1.0, 2.0, 3.1]]), torch.tensor([[1.0, 2.0, 3.0]])
    count, index = inferenceModel(CountEqual())(x, y)
    eager_count, eager_index = CountEqual()(x, y)
    assert eager_count.dtype == torch.int64 and count.dtype == torch.int32 and index.dtype == torch.int32
    assert_close(count, eager_count.to(torch.int32))
    assert_close(index, eager_index.to(torch.int32))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_call_inside_inference_mode_gives_eagers_outputs(replicas):
    """Lightning's validation loop calls the model under ``torch.inference_mode()``; the
    device's storage and its run must not become inference tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(4 * replicas, 3)
    ipu = inferenceModel(model, Options().replicationFactor(replicas))
    for _ in range(2):
        with torch.inference_mode():
            out = ipu(x)
        assert_close(out, model(x).detach())
