"""inferenceModel, weight sync between host module and device, dropout seeding,
attach/detach, and the PopTorch front end's errors."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import ipuxl
from ipuxl import Options
from ipuxl.errors import (
    BatchSizeError, DetachedError, FrozenOptionsError, InvalidArgumentError, OptionsError, TraceError,
)

from tests.poptorch_compat.runtime.test_executor import MLP, eager_steps, make_data

TOL = dict(rtol=1e-5, atol=1e-6)


class DropNet(nn.Module):
    """Dropout and BatchNorm: both behave differently in training and eval."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.model(x)
        return out, self.loss(out, y)


def test_inference_equals_eager_eval_and_returns_all_iterations():
    torch.manual_seed(0)
    net = DropNet()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-1, 1)
        net.bn.running_var.uniform_(0.5, 2)
    x, _ = make_data(3 * 10)
    out = ipuxl.inferenceModel(net, Options().deviceIterations(3))(x)
    assert out.shape == (30, 5)  # inference default output mode: All
    assert net.training  # the module's own mode is left alone
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(out, net(x), **TOL)


def test_inference_model_picks_up_trained_weights():
    """Seed 003's pattern: train the model-with-loss, then inferenceModel(inner model)."""
    torch.manual_seed(1)
    net = DropNet()
    training = ipuxl.trainingModel(WithLoss(net), Options().deviceIterations(2).randomSeed(3),
                                   optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    inference = ipuxl.inferenceModel(net)
    x, y = make_data(8)
    before = inference(x[:4])
    training(x, y)
    after = inference(x[:4])  # weights trained on the device reach the inference device
    net.eval()
    with torch.no_grad():
        expected = net(x[:4])
    torch.testing.assert_close(after, expected, **TOL)
    assert not torch.allclose(before, after)
    training(x, y)
    with torch.no_grad():
        torch.testing.assert_close(inference(x[:4]), net(x[:4]), **TOL)
    assert inference.compile_count == 1


def test_host_weights_refresh_lazily_and_copy_to_device():
    torch.manual_seed(2)
    model = MLP()
    ref = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, Options().deviceIterations(2), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(8)
    training(x, y)
    eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    # every way of reading the host module sees the device's weights
    torch.testing.assert_close(model.fc1.weight, ref.fc1.weight, **TOL)
    training(x, y)
    eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    torch.testing.assert_close(model.state_dict()["fc2.bias"], ref.state_dict()["fc2.bias"], **TOL)
    training(x, y)
    eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    # host -> device: host edits reach the device before the next call (copyWeightsToDevice
    # forces it now)
    for copy_now in (False, True):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        if copy_now:
            training.copyWeightsToDevice()
        out, _ = training(x[:4].repeat(2, 1), y[:4].repeat(2))
        # zero weights on the device: step 1 outputs 0; fc1 gives 0, so fc2.weight gets no
        # gradient and in step 2 every row is fc2.bias after one SGD step
        assert out.abs().sum() > 0
        torch.testing.assert_close(out, out[0].expand_as(out), rtol=0, atol=0)
        torch.testing.assert_close(model.fc1.weight, torch.zeros_like(model.fc1.weight), rtol=0, atol=0)
    assert training.compile_count == 1


def test_dropout_is_random_per_iteration_reproducible_and_off_in_inference():
    torch.manual_seed(3)
    net = DropNet()
    x = torch.randn(4, 12).repeat(4, 1)  # the same micro-batch four times
    y = torch.zeros(16, dtype=torch.long)

    def run(seed):
        model = copy.deepcopy(net)
        opts = Options().deviceIterations(4).randomSeed(seed).outputMode(ipuxl.OutputMode.All)
        return ipuxl.trainingModel(WithLoss(model), opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))(x, y)[0]

    first, again, other = run(7), run(7), run(8)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    steps = first.reshape(4, 4, 5)
    assert not torch.allclose(steps[0], steps[1])  # a fresh mask every iteration
    assert not torch.allclose(first, other)
    inference = ipuxl.inferenceModel(net, Options().deviceIterations(4))
    out = inference(x).reshape(4, 4, 5)
    torch.testing.assert_close(out[0], out[3], rtol=0, atol=0)


def test_dropout_scales_kept_units_like_torch():
    torch.manual_seed(4)

    class OnlyDrop(nn.Module):
        def forward(self, x, y):
            out = nn.functional.dropout(x, 0.25, self.training)
            return out, ipuxl.identity_loss(out.sum() * 0 + y.float().sum(), "none")

    x = torch.rand(200, 50) + 1.0
    out, _ = ipuxl.trainingModel(OnlyDrop(), Options().randomSeed(1))(x, torch.zeros(200, dtype=torch.long))
    kept = out != 0
    torch.testing.assert_close(out[kept], x[kept] / 0.75)
    assert 0.2 < 1 - kept.float().mean().item() < 0.3


def test_detach_attach_and_destroy():
    torch.manual_seed(5)
    model = MLP()
    training = ipuxl.trainingModel(model, Options().deviceIterations(2), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(8)
    training(x, y)
    assert training.isAttachedToDevice()
    training.detachFromDevice()
    assert not training.isAttachedToDevice()
    trained = model.fc1.weight.detach().clone()
    with torch.no_grad():
        model.fc1.weight.add_(1.0)  # attaching copies the host weights to the device
    expected = model.fc1.weight.detach().clone()
    training.attachToDevice()
    torch.testing.assert_close(model.fc1.weight.detach(), expected)
    training.detachFromDevice()
    out, _ = training(x, y)  # as PopTorch: calling a detached model attaches it
    assert training.isAttachedToDevice()
    assert training.compile_count == 1
    assert (model.fc1.weight - trained).abs().min() > 0.5
    training.destroy()
    assert not training.isCompiled()
    with pytest.raises(DetachedError, match="destroyed"):
        training.attachToDevice()  # nothing to attach until it compiles again
    host = model.fc1.weight.detach().clone()
    training(x, y)  # as PopTorch: a call compiles a destroyed model again, from the host's weights
    assert training.compile_count == 2 and training.isAttachedToDevice()
    assert (model.fc1.weight - host).abs().max() > 0


def test_shape_change_recompiles_or_raises_with_static_shapes():
    torch.manual_seed(6)
    model = MLP()
    ref = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, Options().deviceIterations(2), optimizer=torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                                momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data(8)
    training(x, y)
    eager_steps(ref, ref_opt, x, y, 4)
    training(x[:6], y[:6])  # micro-batch 3 now: a new program, same weights and momentum
    eager_steps(ref, ref_opt, x[:6], y[:6], 3)
    assert training.compile_count == 2
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    static = ipuxl.trainingModel(MLP(), Options().deviceIterations(2).staticShapes())
    static(x, y)
    with pytest.raises(TraceError, match=r"compiled for inputs \[4, 12\] float32"):
        static(x[:6], y[:6])


# -- errors -------------------------------------------------------------------------------------
def test_batch_not_divisible_names_factors_and_nearest_sizes():
    opts = Options().deviceIterations(4)
    opts.Training.gradientAccumulation(2)
    training = ipuxl.trainingModel(MLP(), opts)
    x, y = make_data(20)
    with pytest.raises(BatchSizeError, match=r"deviceIterations 4 x gradientAccumulation 2.*= 8") as info:
        training(x, y)
    assert "nearest: 16 or 24" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_model_without_loss_is_refused_with_its_source_line():
    net = nn.Linear(12, 5)
    with pytest.raises(TraceError, match="returns no loss") as info:
        ipuxl.trainingModel(net, Options())(torch.randn(2, 12))
    assert "identity_loss" in str(info.value)


def test_optimizer_over_other_parameters_is_refused():
    model, other = MLP(), MLP()
    with pytest.raises(InvalidArgumentError, match="not .*model"):
        ipuxl.trainingModel(model, Options(), optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_options_freeze_when_a_model_is_wrapped_with_them():
    """As upstream's PoplarExecutor: the user's options are frozen when wrapped; the model keeps a copy."""
    opts = Options().deviceIterations(2)
    training = ipuxl.trainingModel(MLP(), opts)
    with pytest.raises(FrozenOptionsError, match="deviceIterations"):
        opts.deviceIterations(3)
    with pytest.raises(FrozenOptionsError):
        opts.Training.gradientAccumulation(2)
    assert training.options is not opts and training.options.device_iterations == 2
    training(*make_data(12))


def test_item_used_as_a_number_in_tensor_arithmetic_is_captured():
    class ItemModel(MLP):
        def forward(self, x, y):
            scale = x.abs().max().item()  # stays a device value: captured as a tensor op
            return super().forward(x / scale, y)

    torch.manual_seed(7)
    model = ItemModel()
    ref = copy.deepcopy(model)
    x, y = make_data(8)
    ipuxl.trainingModel(model, Options().deviceIterations(2), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(x, y)
    eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def test_untraceable_modules_name_the_line():
    class ItemModel(MLP):
        def forward(self, x, y):
            for _ in range(int(x.abs().max().item())):  # a Python loop count from data
                x = x * 0.5
            return super().forward(x, y)

    class BranchModel(MLP):
        def forward(self, x, y):
            if x.sum() > 0:
                x = -x
            return super().forward(x, y)

    for cls, line in ((ItemModel, "for _ in range"), (BranchModel, "if x.sum() > 0")):
        with pytest.raises(TraceError, match="cannot capture module") as info:
            ipuxl.trainingModel(cls(), Options())(*make_data(4))
        assert "test_weight_sync.py" in info.value.where and "forward" in info.value.where
        path, rest = info.value.where.rsplit(":", 1)
        assert line in open(path).readlines()[int(rest.split()[0]) - 1]
        assert "torch.where" in info.value.fix


def test_replication_factor_is_validated():
    with pytest.raises(OptionsError):
        Options().replicationFactor(0)
    training = ipuxl.trainingModel(MLP(), Options().replicationFactor(2))
    training(*make_data(4))  # two replicas of 2 samples each (see tests/poptorch_compat/compile/test_batching.py)
    with pytest.raises(BatchSizeError, match="replicationFactor 2"):
        training(*make_data(3))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_training_with_dropout_equals_eager_replaying_the_device_masks(accumulation):
    """Dropout end to end: eager steps with the device's masks give the device's weights."""
    from ipuxl.poptorch_compat import DropoutReplay

    torch.manual_seed(11)
    net = DropNet()
    ref = copy.deepcopy(net)
    opts = Options().deviceIterations(3).randomSeed(5)
    opts.Training.gradientAccumulation(accumulation)
    training = ipuxl.trainingModel(WithLoss(net), opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    ref_model, ref_opt = WithLoss(ref), torch.optim.SGD(ref.parameters(), lr=0.1)
    replay = DropoutReplay(5, accumulation)
    for call in range(2):
        x, y = make_data(3 * accumulation * 4, seed=call)
        training(x, y)
        for xs, ys in zip(x.split(4 * accumulation), y.split(4 * accumulation)):
            ref_opt.zero_grad()
            for xm, ym in zip(xs.split(4), ys.split(4)):
                with replay.step():
                    (ref_model(xm, ym)[1] / accumulation).backward()
            ref_opt.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
