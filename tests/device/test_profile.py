"""``Session.profile`` / ``PoplarExecutor.profile``: labelled runs under ``torch.profiler``.

The profiled runs are real runs, so the oracle is a normal session (or model) run
the same number of times, and eager PyTorch for the values. The table is checked
for what it names (ops, graphs, the source lines of this file, call counts) and
for shares that add up, never for times.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.device.profile import HOST, OUTSIDE, Profile
from ipuxl.errors import DetachedError, InvalidValueError

F32 = ipuxl.float32
STEPS = 3
LR = 0.1


def _line(marker: str) -> str:
    """``"test_profile.py:N"`` for the line of this file holding ``marker``."""
    lines = Path(__file__).read_text().splitlines()
    number = next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)
    return f"test_profile.py:{number}"


def _program(w0: np.ndarray, v0: np.ndarray):
    """``STEPS`` steps of ``y = ((x @ w) / 4) @ v; w -= LR * x^T y``: ``lin`` is called from
    two sites (compiled once), ``halve`` is a loop carrying ``h``, the step a device loop."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = STEPS
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((4, 2), F32, "x")
        y_stream = ipuxl.d2h_stream((4, 2), F32, "y")
        w = ipuxl.variable(w0, name="w")
        v = ipuxl.variable(v0, name="v")

        def lin(a, b):
            return ops.matmul(a, b)  # the profiled matmul

        def halve(h):
            return h * 0.5

        lin_graph = ir.create_graph(lin, ipuxl.TensorSpec((4, 2), F32), ipuxl.TensorSpec((2, 2), F32))
        halve_graph = ir.create_graph(halve, ipuxl.TensorSpec((4, 2), F32))

        def step(w: ipuxl.TensorByRef, v: ipuxl.TensorByRef):
            x = ops.host_load(x_stream)
            h = ops.repeat(halve_graph, 2, ops.call(lin_graph, x, w)[0])[0]
            y = ops.call(lin_graph, h, v)[0]
            ops.host_store(y_stream, y)
            ops.var_updates.accumulate_(w, ops.matmul(ops.transpose(x), y), -LR)

        ops.repeat(ir.create_graph(step, w, v), STEPS, w, v)
    return ir, x_stream, y_stream, w


def _eager(w0: np.ndarray, v0: np.ndarray, xs: np.ndarray, runs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last run's outputs and ``w`` after ``runs`` runs, in eager torch."""
    w, v = torch.tensor(w0), torch.tensor(v0)
    for _ in range(runs):
        ys = []
        for x in torch.tensor(xs):
            y = (x @ w) * 0.25 @ v
            w = w - LR * x.T @ y
            ys.append(y)
    return torch.stack(ys), w


def _data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(shape).astype(np.float32) for shape in ((2, 2), (2, 2), (STEPS, 4, 2)))


def _row(profile: Profile, *fragments: str):
    """The labelled-op row whose label holds every fragment (exactly one)."""
    rows = [r for r in profile.ops if all(f in r.name for f in fragments)]
    assert len(rows) == 1, f"{fragments} in {[r.name for r in profile.ops]}"
    return rows[0]


def _assert_shares_add_up(profile: Profile) -> None:
    assert profile.total_us > 0
    assert sum(r.share for r in profile.ops) == pytest.approx(1.0)
    assert sum(r.share for r in profile.aten_ops) == pytest.approx(1.0)
    assert sum(r.self_us for r in profile.ops) == pytest.approx(profile.total_us)


# -- PopXL sessions ------------------------------------------------------------------------
def test_session_profile_runs_are_real_runs_and_label_every_graph(tmp_path):
    w0, v0, xs = _data()
    ir, x_stream, y_stream, w = _program(w0, v0)
    ref_ir, ref_x, ref_y, ref_w = _program(w0, v0)
    with ipuxl.Session(ir, "cpu") as session, ipuxl.Session(ref_ir, "cpu") as normal:
        profile = session.profile({x_stream: xs}, runs=2, warmup=1, trace_path=tmp_path / "trace.json")
        for _ in range(3):
            ys = normal.run({ref_x: xs})[ref_y]
        ys_after = session.run({x_stream: xs})[y_stream]  # normal runs again after profiling
        ref_after = normal.run({ref_x: xs})[ref_y]
    assert_close(session.get_tensor_data(w), normal.get_tensor_data(ref_w), rtol=0, atol=0)
    assert_close(ys_after, ref_after, rtol=0, atol=0)
    assert_close(torch.tensor(ys), _eager(w0, v0, xs, runs=3)[0])
    assert_close(torch.tensor(normal.get_tensor_data(ref_w)), _eager(w0, v0, xs, runs=4)[1])

    matmul = _row(profile, ": matmul", _line("# the profiled matmul"))
    assert matmul.name.startswith("_program.lin_subgraph(")  # the graph it was built in
    assert matmul.calls == 2 * STEPS * 2  # two call sites, STEPS steps, 2 profiled runs
    assert _row(profile, "halve_subgraph(", ": mul").calls == 2 * STEPS * 2  # the loop runs twice a step
    assert _row(profile, "main_graph: repeat _program.step_subgraph(").calls == 2
    assert _row(profile, HOST).calls == 2
    _assert_shares_add_up(profile)


def test_session_profile_writes_a_chrome_trace_with_the_labels(tmp_path):
    w0, v0, xs = _data()
    ir, x_stream, _, _ = _program(w0, v0)
    path = tmp_path / "trace.json"
    with ipuxl.Session(ir, "cpu") as session:
        profile = session.profile({x_stream: xs}, runs=1, warmup=0, trace_path=path)
    assert profile.trace_path == str(path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    labels = [r.name for r in profile.ops if r.name != HOST]
    assert labels and set(labels) <= names
    table = str(profile)
    assert "time by labelled op" in table and "time by aten op" in table
    assert "aten::mm" in table and _line("# the profiled matmul") in table


def test_session_profile_without_a_trace_path_writes_nothing(tmp_path, monkeypatch):
    w0, v0, xs = _data()
    ir, x_stream, _, _ = _program(w0, v0)
    monkeypatch.chdir(tmp_path)
    with ipuxl.Session(ir, "cpu") as session:
        profile = session.profile({x_stream: xs}, runs=1, top=3)
    assert profile.trace_path is None and not list(tmp_path.iterdir())
    assert len(profile.table().splitlines()) == 2 + 3  # two header lines, top=3 rows
    assert profile.table(top=1, by="aten").splitlines()[2].endswith(profile.aten_ops[0].name)
    with pytest.raises(InvalidValueError, match="by must be 'op' or 'aten', got 'torch'"):
        profile.table(by="torch")


def test_session_profile_is_refused_as_run_is():
    w0, v0, xs = _data()
    ir, x_stream, _, _ = _program(w0, v0)
    session = ipuxl.Session(ir, "cpu")
    with pytest.raises(DetachedError, match=r"Must be attached to device before calling a runtime function \(Session.profile\)"):
        session.profile({x_stream: xs})
    with session:
        with pytest.raises(InvalidValueError, match="runs must be an int >= 1, got 0"):
            session.profile({x_stream: xs}, runs=0)
        with pytest.raises(InvalidValueError, match="warmup must be an int >= 0, got -1"):
            session.profile({x_stream: xs}, warmup=-1)
        with pytest.raises(ipuxl.errors.StreamInputError, match="no data for input stream 'x'"):
            session.profile({})


def test_session_profile_refuses_several_replicas():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2,), F32, "x")
        ops.host_store(ipuxl.d2h_stream((2,), F32, "y"), ops.host_load(x_stream) * 2.0)
    with ipuxl.Session(ir, "cpu") as session:
        with pytest.raises(ipuxl.errors.UnsupportedError, match="runs 2 replicas in this process"):
            session.profile({x_stream: np.ones((2, 2), np.float32)})


# -- PopTorch models -----------------------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 4 * 4, 5)

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x)))  # the profiled convolution
        out = self.fc(h.flatten(1))
        return out, torch.nn.functional.cross_entropy(out, y)


def _training(model: torch.nn.Module) -> ipuxl.PoplarExecutor:
    opts = ipuxl.Options().deviceIterations(2)
    return ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(8, 3, 6, 6), torch.randint(0, 5, (8,))


def test_model_profile_calls_are_real_calls_and_name_the_models_ops(tmp_path):
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    x, y = _batch()
    training, normal = _training(model), _training(reference)
    profile = training.profile(x, y, runs=2, warmup=1, trace_path=tmp_path / "trace.json")
    for _ in range(3):
        normal(x, y)
    assert training.compile_count == 1  # the first (warm-up) call compiled, as calling does
    for (name, got), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert_close(got, expected, rtol=0, atol=0, msg=name)
    out, loss = training(x, y)
    ref_out, ref_loss = normal(x, y)
    assert_close(out, ref_out, rtol=0, atol=0)

    conv = _row(profile, ": convolution ", _line("# the profiled convolution"))
    assert conv.calls == 2 * 2  # deviceIterations(2), 2 profiled calls
    assert any("convolution_backward" in r.name for r in profile.ops)
    assert any(r.name == "aten::convolution_backward" for r in profile.aten_ops)
    assert any(r.name == OUTSIDE for r in profile.aten_ops)
    _assert_shares_add_up(profile)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert conv.name in {e.get("name") for e in events}


def test_model_profile_compiles_an_uncompiled_model_without_an_extra_call():
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    x, y = _batch()
    training, normal = _training(model), _training(reference)
    training.profile(x, y, runs=1, warmup=0)
    normal(x, y)
    assert training.compile_count == 1
    for (name, got), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert_close(got, expected, rtol=0, atol=0, msg=name)


def test_model_profile_attaches_and_is_refused_as_calling_is():
    torch.manual_seed(0)
    x, y = _batch()
    training = _training(_Net())
    training(x, y)
    training.detachFromDevice()
    training.profile(x, y, runs=1, warmup=0)  # as calling it (PopTorch): a detached model attaches
    assert training.isAttachedToDevice()
    with pytest.raises(InvalidValueError, match="top must be an int >= 1"):
        training.profile(x, y, top=0)
    training.destroy()
    with pytest.raises(DetachedError, match="cannot profile the model: the training model was destroyed"):
        training.profile(x, y)
