"""PoplarExecutor's PopTorch API: perf counters and latencies, tensor names, compile
hooks, rng_state, executable files (compileAndExport / save / load / loadExecutable),
module-like accessors and the not-compiled errors."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import ExecutorError, InvalidValueError, PoptorchError
from tests.poptorch_compat._checks import raises_in

raises = raises_in(__file__)


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, y=None):
        out = self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))
        return out if y is None else (out, nn.functional.cross_entropy(out, y))


def data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def training_model(dropout: float = 0.0, iterations: int = 2, lr: float = 0.05, seed: int = 0):
    torch.manual_seed(seed)
    model = Net(dropout)
    opts = poptorch.Options().deviceIterations(iterations).randomSeed(7)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, poptorch.trainingModel(model, opts, optimizer=opt)


# -- perf counters and latencies ---------------------------------------------------------------
def test_perf_counters_shape_order_and_latencies():
    _, training = training_model(iterations=3)
    empty = training.getPerfCounters()
    assert empty == {k: [[]] for k in ("input", "input_complete", "output", "output_complete")}
    assert training.getLatency() == (0.0, 0.0, 0.0)
    x, y = data(12)
    training(x, y)
    pc = training.getPerfCounters()
    assert [len(pc["input"]), len(pc["input_complete"])] == [2, 2]  # x and y
    assert [len(pc["output"]), len(pc["output_complete"])] == [2, 2]  # logits and loss
    assert all(len(row) == 3 and all(isinstance(v, float) for v in row) for rows in pc.values() for row in rows)
    t = {k: v[0][0] for k, v in pc.items()}
    assert t["input"] <= t["input_complete"] <= t["output"] <= t["output_complete"]
    lat = training.getLatency()
    assert lat[0] == lat[1] == pytest.approx(lat[2]) == pytest.approx(t["output_complete"] - t["input"])
    assert training.getComputeLatency()[0] == pytest.approx(t["output"] - t["input_complete"])
    assert training.getHostIpuLatency()[0] == pytest.approx(t["input_complete"] - t["input"])
    assert training.getIpuHostLatency()[0] == pytest.approx(t["output_complete"] - t["output"])
    training(x, y)
    assert training.getPerfCounters()["input"][0][0] > t["output_complete"]  # the last call's


def test_cycle_count_is_refused():
    _, training = training_model()
    with raises(ExecutorError, "Cycle count logging is disabled"):  # upstream's, without logCycleCount
        training.cycleCount()
    model = poptorch.inferenceModel(Net(0.0), poptorch.Options().logCycleCount(True))
    with raises(ExecutorError, "no hardware cycle counter"):
        model.cycleCount()


# -- tensor names, state queries, accessors -------------------------------------------------------
def test_tensor_names_and_not_compiled_errors(caplog):
    model, training = training_model()
    assert not training.isCompiled() and not training.isAttachedToDevice()
    with raises(ExecutorError, "Model must be compiled before calling getTensorNames") as info:
        training.getTensorNames()  # upstream asserts: also an AssertionError
    assert isinstance(info.value, AssertionError)
    with raises(ExecutorError, "rng_state", "Model has not been compiled"):
        training.rng_state
    with raises(ExecutorError, "save"):
        training.save("unused.ipuxl")
    training.compile(*data(4))
    assert training.isCompiled() and training.isAttachedToDevice()
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        training.compile(*data(4))
    assert "Call to compile() ignored" in caplog.text and training.compile_count == 1
    names = training.getTensorNames()
    assert all(isinstance(n, str) for n in names) and len(names) == len(set(names))
    assert {"fc1.weight", "fc2.bias", "bn.running_mean"} <= set(names)
    training.detachFromDevice()
    assert training.isCompiled() and not training.isAttachedToDevice()
    training.destroy()
    assert not training.isCompiled()


def test_module_accessors_are_the_wrapped_modules():
    torch.manual_seed(0)
    model = Net()
    training = poptorch.trainingModel(model, poptorch.Options(), loss=nn.functional.cross_entropy,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert training.model is model
    assert training.options.device_iterations == 1
    assert repr(training) == repr(model)
    assert [n for n, _ in training.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in training.named_buffers()] == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    x, y = data(4)
    training(x, y)
    for a, b in zip(training.parameters(), model.parameters()):
        assert a is b
    for a, b in zip(training.buffers(), model.buffers()):
        assert a is b


# -- compile hooks -------------------------------------------------------------------------------
def test_compile_hooks_run_around_each_compile_and_can_be_removed():
    calls = []
    pre = poptorch.registerPreCompileHook(lambda: calls.append("pre"))
    post = poptorch.registerPostCompileHook(lambda: calls.append("post"))
    try:
        _, training = training_model()
        x, y = data(4)
        training(x, y)
        training(x, y)  # no compile
        assert calls == ["pre", "post"]
        training(*data(8))  # a new batch size compiles again
        assert calls == ["pre", "post", "pre", "post"]
    finally:
        pre.remove()
        post.remove()
    _, other = training_model()
    other(*data(4))
    assert calls == ["pre", "post", "pre", "post"]


def test_post_compile_hook_runs_when_compiling_fails():
    calls = []
    handle = poptorch.registerPostCompileHook(lambda: calls.append("post"))
    try:
        model = nn.Linear(3, 2)  # returns no loss: a training model cannot compile it
        training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(PoptorchError):  # poptorch.Error
            training(torch.ones(2, 3))
        assert calls == ["post"]
    finally:
        handle.remove()


def test_hook_must_be_callable():
    with raises(ExecutorError, "Post-compile hook must be callable") as info:
        poptorch.registerPostCompileHook(3)
    assert isinstance(info.value, RuntimeError)
    with raises(ExecutorError, "Pre-compile hook must be callable"):
        poptorch.registerPreCompileHook("hook")


# -- rng_state ------------------------------------------------------------------------------------
def test_rng_state_replays_the_random_draws():
    _, training = training_model(dropout=0.5, lr=0.0)  # lr 0: only the dropout masks change outputs
    x, y = data(8)
    training.compile(x, y)
    state = training.rng_state
    assert isinstance(state, list) and len(state) == 2 and all(isinstance(v, int) for v in state)
    first, _ = training(x, y)
    assert training.rng_state != state  # the generator advanced
    second, _ = training(x, y)
    assert not torch.equal(first, second)
    training.rng_state = state
    again, _ = training(x, y)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_rng_state_set_while_detached_is_written_on_attach():
    _, training = training_model(dropout=0.5, lr=0.0)
    x, y = data(8)
    training.compile(x, y)
    state = training.rng_state
    first, _ = training(x, y)
    training.detachFromDevice()
    assert training.rng_state != state  # read back when detaching
    training.rng_state = state
    training.attachToDevice()
    again, _ = training(x, y)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_rng_state_wrong_length():
    _, training = training_model(dropout=0.5)
    training.compile(*data(4))
    with raises(InvalidValueError, "rng_state must hold 2 seed words", "got 3"):
        training.rng_state = [1, 2, 3]


# -- executable files ---------------------------------------------------------------------------
def test_compile_and_export_then_load_continues_training_exactly(tmp_path):
    model, training = training_model(dropout=0.3)
    x, y = data(8, seed=1)
    training(x, y)  # some steps: momentum state and rng advanced
    path = tmp_path / "sub" / "model.ipuxl"
    training.save(path)
    loaded = poptorch.load(path)
    assert loaded.isCompiled() and loaded.training and loaded.compile_count == 1
    assert loaded.model is not model
    x2, y2 = data(8, seed=2)
    out_a, loss_a = training(x2, y2)
    out_b, loss_b = loaded(x2, y2)
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.model.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_load_edits_options_and_inference_round_trip(tmp_path):
    torch.manual_seed(3)
    model = Net()
    inference = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    x, _ = data(4)
    inference.compileAndExport(tmp_path / "inf.ipuxl", x)
    assert inference.isCompiled()

    def edit(opts):
        opts.deviceIterations(2)

    loaded = poptorch.load(tmp_path / "inf.ipuxl", edit_opts_fn=edit)
    assert not loaded.training
    torch.testing.assert_close(loaded(x), inference(x), rtol=0, atol=0)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)


def test_export_without_model_needs_load_executable(tmp_path):
    model, training = training_model()
    x, y = data(4)
    path = tmp_path / "exe.ipuxl"
    training.compileAndExport(path, x, y, export_model=False)
    with raises(ExecutorError, "holds no model", "export_model=False"):
        poptorch.load(path)
    other_model = copy.deepcopy(model)
    other = poptorch.trainingModel(other_model, poptorch.Options().deviceIterations(2),
                                   optimizer=torch.optim.SGD(other_model.parameters(), lr=0.05, momentum=0.9))
    other.loadExecutable(path)
    assert other.isCompiled() and other.compile_count == 1
    torch.testing.assert_close(other(x, y)[1], training(x, y)[1], rtol=0, atol=0)
    inference = poptorch.inferenceModel(copy.deepcopy(model))
    with raises(ExecutorError, "holds a training executable", "inference model"):
        inference.loadExecutable(path)


def test_save_into_a_directory_and_invalid_files(tmp_path):
    _, training = training_model()
    training.compile(*data(4))
    training.save(tmp_path)
    assert (tmp_path / "model.poptorch").is_file()
    assert poptorch.load(tmp_path / "model.poptorch").isCompiled()
    bad = tmp_path / "bad.popef"
    bad.write_bytes(b"not a pickle")
    with raises(ExecutorError, "Invalid file", "not an ipuxl executable file"):
        poptorch.load(bad)
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    with raises(ExecutorError, "not an ipuxl executable file"):
        poptorch.load(tmp_path / "other.pt")
    with raises(ExecutorError, "no executable file"):
        poptorch.load(tmp_path / "missing.ipuxl")


def test_version():
    assert poptorch.__version__.startswith("3.") and "ipuxl" in poptorch.__version__
