"""State safety of PopTorch-style models: trained weights, checkpoints and device state
are never stale or lost, forward has eager autograd semantics, wrappers are released.

Most weight tests run in both storage modes of ``poptorch_compat.runtime.weights``: "bound"
(the CPU default: the module's tensors are the device storage) and "copied" (the
device keeps a copy, as on CUDA or with replicas; forced here on the CPU).
"""
from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
import torch.nn as nn

import ipuxl
from ipuxl import Options
from ipuxl.errors import AlreadyWrappedError, DeviceError, InvalidArgumentError, StreamInputError, TraceError
from ipuxl.poptorch_compat.runtime import weights

from tests.poptorch_compat._checks import raises_in
from tests.poptorch_compat.runtime.test_executor import MLP, assert_same_weights, eager_steps, make_data

TOL = dict(rtol=1e-5, atol=1e-6)
raises = raises_in(__file__)


@pytest.fixture(params=["bound", "copied"])
def storage(request, monkeypatch):
    """Run the test with the module's tensors as device storage, or with a device copy."""
    if request.param == "copied":
        monkeypatch.setattr(weights, "_bindable", lambda *args: False)
    return request.param


def _train(model, n=2, optimizer=None, **opts):
    options = Options().deviceIterations(n)
    if "random_seed" in opts:
        options.randomSeed(opts["random_seed"])
    return ipuxl.trainingModel(model, options, optimizer=optimizer or torch.optim.SGD(model.parameters(), lr=0.1))


def _one_call_each(seed: int):
    """A model trained by one call (2 SGD steps) and an eager copy trained the same."""
    torch.manual_seed(seed)
    model = MLP()
    ref = copy.deepcopy(model)
    training = _train(model)
    x, y = make_data(8)
    training(x, y)
    eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    return model, ref, training, x, y


# -- one rule for where the weights are -------------------------------------------------------
def test_storage_modes_are_the_ones_asked_for(storage):
    model = MLP()
    training = _train(model)
    training(*make_data(8))
    assert {s.bound for s in training._slots.slots} == {storage == "bound"}


def test_module_load_state_dict_after_training_reaches_the_device(storage):
    torch.manual_seed(0)
    model = MLP()
    checkpoint = copy.deepcopy(model.state_dict())
    training = _train(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    x, y = make_data(8)
    training(x, y)
    model.load_state_dict(checkpoint)  # back to the initial weights, on the user's module
    for name, value in checkpoint.items():  # not replaced by the device's weights when read
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
    training(x, y)
    # eager: the momentum of the first two steps, applied to the reloaded weights
    ref = MLP()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref.load_state_dict(checkpoint)
    eager_steps(ref, ref_opt, x, y, 4)
    ref.load_state_dict(checkpoint)
    eager_steps(ref, ref_opt, x, y, 4)
    assert_same_weights(model, ref)


def test_training_model_load_state_dict_reaches_the_device(storage):
    torch.manual_seed(1)
    model = MLP()
    checkpoint = copy.deepcopy(model.state_dict())
    training = _train(model)
    x, y = make_data(8)
    training(x, y)
    result = training.load_state_dict(checkpoint)  # PopTorch: "updates the device too"
    assert not result.missing_keys and not result.unexpected_keys
    out, _ = training(x, y)
    ref = MLP()
    ref.load_state_dict(checkpoint)
    ref_out, _ = eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    torch.testing.assert_close(out, ref_out[-1], **TOL)
    assert_same_weights(model, ref)
    assert set(training.state_dict()) == set(checkpoint)  # the user's module's keys, not a wrapper's


def test_host_edits_under_no_grad_reach_the_device(storage):
    torch.manual_seed(2)
    model = MLP()
    training = _train(model)
    x, y = make_data(8)
    held = list(model.parameters())  # references taken before training
    training(x, y)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        held[0].mul_(0.5)  # through an old reference, without reading the module first
        model.fc2.bias.fill_(0.25)
        ref.fc1.weight.mul_(0.5)
        ref.fc2.bias.fill_(0.25)
    training(x, y)
    eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    assert_same_weights(model, ref)


def test_replacing_a_parameter_object_reaches_the_device(storage):
    torch.manual_seed(3)
    model = MLP()
    training = _train(model)
    x, y = make_data(8)
    training(x, y)
    ref = copy.deepcopy(model)
    new = {"fc1.weight": torch.full_like(model.fc1.weight, 0.01)}
    model.load_state_dict(new, strict=False, assign=True)  # a new Parameter object in the module
    ref.load_state_dict(new, strict=False)
    model.fc2.bias.data = torch.full((5,), 0.5)  # new data behind the same Parameter
    ref.fc2.bias.data = torch.full((5,), 0.5)
    for _ in range(2):
        training(x, y)
        eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("save", ["torch.save", "pickle", "deepcopy"])
def test_saving_the_whole_module_after_training_saves_the_trained_weights(storage, save):
    model, ref, training, x, y = _one_call_each(4)  # and no read of the module before saving
    if save == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        assert b"ipuxl" not in buffer.getvalue()  # loads without ipuxl
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
    elif save == "pickle":
        saved = pickle.loads(pickle.dumps(model))
    else:
        saved = copy.deepcopy(model)
    assert type(saved) is MLP  # the user's own class
    assert_same_weights(saved, ref)
    training(x, y)  # the copy is independent of the device
    assert not torch.equal(saved.fc1.weight, model.fc1.weight)


def test_module_to_after_training_converts_the_trained_weights(storage):
    model, ref, training, x, y = _one_call_each(5)
    model.to(torch.float64)  # the first read of the module after training
    assert model.fc1.weight.dtype == torch.float64
    assert_same_weights(model, ref.to(torch.float64))


def test_a_parameter_converted_after_compiling_is_refused_by_name():
    model, ref, training, x, y = _one_call_each(15)
    model.double()  # the trained weights, converted; reading the module still works
    assert_same_weights(model, ref.double())
    with raises(InvalidArgumentError, "'fc1.weight'", "float64", "float32"):
        training(x, y)


@pytest.mark.parametrize("make", [torch.optim.Adam, ipuxl.optim.Adam])
def test_optimizer_state_dict_holds_the_device_state(storage, make):
    """Saved without reading the weights first; restored into a fresh model and optimiser."""
    torch.manual_seed(6)
    model = MLP()
    ref = copy.deepcopy(model)
    optimizer = make(model.parameters(), lr=0.01)
    ref_opt = make(ref.parameters(), lr=0.01)
    training = _train(model, optimizer=optimizer)
    x, y = make_data(8)
    training(x, y)
    eager_steps(ref, ref_opt, x, y, 4)
    saved_opt = copy.deepcopy(optimizer.state_dict())  # first, before any weight read
    saved_model = copy.deepcopy(model.state_dict())
    expected = ref_opt.state_dict()["state"]
    assert sorted(saved_opt["state"]) == sorted(expected) and len(expected) == 4
    for index, state in expected.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(saved_opt["state"][index][key], state[key], **TOL)
    # a checkpoint restored into a new model and optimiser continues as eager does
    restored = MLP()
    restored.load_state_dict(saved_model)
    restored_opt = make(restored.parameters(), lr=0.01)
    restored_opt.load_state_dict(saved_opt)
    training.destroy()
    continued = _train(restored, optimizer=restored_opt)
    continued(x, y)
    eager_steps(ref, ref_opt, x, y, 4)
    assert_same_weights(restored, ref, rtol=1e-4, atol=1e-6)


def _check_rewind(options: Options, batch: int, eager_call) -> "ipuxl.PoplarExecutor":
    """Train, save a {model, optimizer} checkpoint, train on, load the checkpoint into the
    module and the torch optimiser, train once more: the weights equal eager's from the
    checkpoint (``eager_call(ref, ref_opt, x, y)`` does one call's steps)."""
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = ipuxl.trainingModel(model, options, optimizer=optimizer)
    x, y = make_data(batch)
    training(x, y)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    training(x, y)
    training(x, y)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    training(x, y)
    ref = MLP()
    ref.load_state_dict(checkpoint["model"])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_opt.load_state_dict(checkpoint["optimizer"])
    eager_call(ref, ref_opt, x, y)
    assert_same_weights(model, ref)
    return training


def test_optimizer_load_state_dict_reaches_the_device(storage):
    """Rewind weights and optimiser to a checkpoint taken mid-training."""
    torch.manual_seed(7)
    _check_rewind(Options().deviceIterations(2), 8, lambda ref, opt, x, y: eager_steps(ref, opt, x, y, 4))


def test_inference_model_sees_weights_trained_by_a_copied_training_model(storage):
    torch.manual_seed(8)
    model = MLP()
    training = _train(model)
    inference = ipuxl.inferenceModel(model)
    x, y = make_data(8)
    inference(x[:4], y[:4])
    training(x, y)
    out, _ = inference(x[:4], y[:4])
    with torch.no_grad():
        expected, _ = model(x[:4], y[:4])
    torch.testing.assert_close(out, expected, **TOL)
    assert inference.compile_count == 1


def test_host_writes_reach_every_replica():
    """With replicas the device keeps copies (one per replica): a loaded checkpoint and an
    optimiser state must reach all of them, or the replicas' mean gradient is wrong."""
    from tests.poptorch_compat.compile.test_batching import eager_reference

    torch.manual_seed(14)
    training = _check_rewind(Options().deviceIterations(2).replicationFactor(2), 2 * 2 * 3,
                             lambda ref, opt, x, y: eager_reference(ref, opt, x, y, 2, 3))
    assert not any(s.bound for s in training._slots.slots)


# -- a failed call --------------------------------------------------------------------------
def test_failed_call_keeps_the_applied_steps_on_host_and_device(storage):
    torch.manual_seed(9)
    model = MLP()
    ref = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    training = _train(model, n=4, optimizer=optimizer)
    x, y = make_data(16)
    bad = y.clone()
    bad[9] = 99  # a label out of range in step 3 of 4
    with pytest.raises(DeviceError, match="step 3 of 4") as info:
        training(x, bad)
    assert info.value.steps_applied == 2
    eager_steps(ref, ref_opt, x[:8], y[:8], 4)  # steps 1 and 2 were applied and kept
    assert_same_weights(model, ref)
    training(x, y)  # continues from there, momentum included
    eager_steps(ref, ref_opt, x, y, 4)
    assert_same_weights(model, ref, rtol=1e-4, atol=1e-6)


# -- eager autograd semantics inside forward ----------------------------------------------------
class Frozen(nn.Module):
    """fc1 under a grad-stopping construct; fc2 trains."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 5)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        if self.how == "no_grad":
            with torch.no_grad():
                h = self.fc1(x)
        elif self.how == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                h = self.fc1(x)
        elif self.how == "inference_mode":
            with torch.inference_mode():
                h = self.fc1(x)
            h = h.clone()  # eager needs a normal tensor for autograd
        elif self.how == "decorator":
            h = _frozen_layer(self.fc1, x)
        elif self.how == "data":
            h = torch.nn.functional.linear(x, self.fc1.weight.data, self.fc1.bias.data)
        elif self.how == "enable_grad_inside_no_grad":  # trains: enable_grad wins
            with torch.no_grad():
                with torch.enable_grad():
                    h = self.fc1(x)
        elif self.how == "requires_grad_false":  # parameters frozen from inside forward
            self.fc1.weight.requires_grad_(False)
            self.fc1.bias.requires_grad_(False)
            h = self.fc1(x)
        h = torch.tanh(h) * (2.0 if h.requires_grad else 1.0)  # eager's requires_grad, as eager sees it
        out = self.fc2(h)
        return out, self.loss(out, y)


@torch.no_grad()
def _frozen_layer(layer, x):
    return layer(x)


HOWS = ["no_grad", "set_grad_enabled", "inference_mode", "decorator", "data", "enable_grad_inside_no_grad",
        "requires_grad_false"]


@pytest.mark.parametrize("how", HOWS)
def test_grad_modes_inside_forward_train_like_eager(how):
    torch.manual_seed(10)
    model = Frozen(how)
    ref, initial = copy.deepcopy(model), copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)  # noqa: E731
    training = ipuxl.trainingModel(model, Options().deviceIterations(3), optimizer=make(model))
    ref_opt = make(ref)
    x, y = make_data(12)
    out, loss = training(x, y)
    ref_out, ref_loss = eager_steps(ref, ref_opt, x, y, 4)
    torch.testing.assert_close(out, ref_out[-1], **TOL)
    torch.testing.assert_close(loss, ref_loss[-1], **TOL)
    assert_same_weights(model, ref)
    frozen = how != "enable_grad_inside_no_grad"
    assert frozen == torch.equal(model.fc1.weight, initial.fc1.weight)  # no gradient, so no weight decay either
    assert frozen == (ref.fc1.weight.grad is None)  # as eager


def test_requires_grad_false_on_an_intermediate_raises_as_eager():
    class Bad(MLP):
        def forward(self, x, y):
            h = self.fc1(x)
            h.requires_grad_(False)
            out = self.fc2(h)
            return out, self.loss(out, y)

    x, y = make_data(4)
    with pytest.raises(RuntimeError, match="leaf variables") as eager:
        Bad()(x, y)
    with pytest.raises(RuntimeError, match="leaf variables") as ours:
        ipuxl.trainingModel(Bad())(x, y)
    assert isinstance(ours.value, TraceError) and "forward" in (ours.value.where or "")
    assert eager.type is RuntimeError


# -- inputs and buffers changed by forward --------------------------------------------------------
class AddOne(nn.Module):
    def forward(self, x):
        x += 1
        return x * 2


def test_inplace_change_of_an_input_reaches_the_callers_tensor():
    """PopTorch's example: ``x += 1`` in forward on tensor([1.]) gives 2, then 3."""
    model = ipuxl.inferenceModel(AddOne())
    x = torch.tensor([1.0])
    torch.testing.assert_close(model(x), torch.tensor([4.0]))
    assert x.item() == 2.0
    torch.testing.assert_close(model(x), torch.tensor([6.0]))
    assert x.item() == 3.0


def test_inplace_input_change_with_iterations_accumulation_and_replicas():
    class Scale(MLP):
        def forward(self, x, y):
            x.mul_(2.0)
            x[:, 0] = y.float()
            return super().forward(x, y)

    torch.manual_seed(11)
    model = Scale()
    ref = copy.deepcopy(model)
    opts = Options().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(2)
    training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(2 * 2 * 2 * 3)
    expected = x.clone()
    for xs, ys in zip(expected.split(3), y.split(3)):  # eager forward on each micro-batch's slice
        ref(xs, ys)
    training(x, y)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_buffer_updates_in_forward_persist_in_inference(storage):
    """PopTorch's buffer example: a counter incremented in forward prints 1, then 2."""
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x):
            self.count += 1
            return x + self.count

    module = Counter()
    model = ipuxl.inferenceModel(module, Options().deviceIterations(2))
    first = model(torch.zeros(2, 3))
    torch.testing.assert_close(first, torch.tensor([[1.0] * 3, [2.0] * 3]))
    torch.testing.assert_close(module.count, torch.tensor([2.0]))
    second = model(torch.zeros(2, 3))
    torch.testing.assert_close(second, torch.tensor([[3.0] * 3, [4.0] * 3]))
    torch.testing.assert_close(module.count, torch.tensor([4.0]))


# -- lifetimes ----------------------------------------------------------------------------------
def test_dropped_wrappers_are_released():
    torch.manual_seed(12)
    model = MLP()
    x, y = make_data(4)
    refs = []
    for _ in range(3):  # a new inference wrapper per epoch, dropped each time
        inference = ipuxl.inferenceModel(model)
        inference(x, y)
        refs.append(weakref.ref(inference))
        del inference
    training = _train(model)
    training(*make_data(8))
    refs.append(weakref.ref(training))
    del training
    gc.collect()
    assert all(r() is None for r in refs)
    assert not model.__dict__["_ipuxl_executors"]
    assert model.fc1.weight.shape == (16, 12)  # the module still works on its own


def test_a_refused_call_leaves_the_model_usable(storage):
    model, ref, training, x, y = _one_call_each(13)
    with pytest.raises(TraceError):
        training(torch.zeros(8, 13), y)  # 13 features into Linear(12, ...): cannot be traced
    training(x, y)  # the program compiled before still runs, from the same weights
    eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    assert_same_weights(model, ref)
    assert training.compile_count == 1 and training.isAttachedToDevice()
    training.detachFromDevice()
    training.attachToDevice()


def test_wrapping_a_module_twice_raises_until_destroy():
    model = MLP()
    first = ipuxl.trainingModel(model)
    with raises(AlreadyWrappedError, "already been wrapped", "MLP") as info:
        ipuxl.trainingModel(model)
    assert isinstance(info.value, RuntimeError) and "destroy()" in info.value.fix
    with raises(AlreadyWrappedError, "already been wrapped"):
        ipuxl.trainingModel(first)  # PopTorch unwraps a wrapper given to trainingModel
    ipuxl.inferenceModel(model)  # inference of a module being trained is fine
    first.destroy()
    second = ipuxl.trainingModel(model)
    del second
    gc.collect()
    ipuxl.trainingModel(model)  # a dropped wrapper no longer holds the module


# -- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_input_dtype_change_after_the_first_call_names_the_input(dtype):
    model = ipuxl.trainingModel(MLP())
    x, y = make_data(4)
    model(x, y)
    with raises(StreamInputError, "input 'x'", str(dtype).replace("torch.", ""), "compiled for float32") as info:
        model(x.to(dtype), y)
    assert "x.to(torch.float32)" in info.value.fix
    model(x, y)  # still usable
