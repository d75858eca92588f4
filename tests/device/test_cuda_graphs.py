"""``device.cuda_graphs``: a session's runs replayed as one CUDA graph each.

Without a GPU the state machine runs with a recorder standing in for CUDA's capture (it
keeps the work and runs it on ``replay``, as a graph replays its launches): replayed runs
must give the compiled runs' outputs and variables, the graph must go when what it reads
may move, and a run that cannot be captured must run as compiled. The tests marked
``cuda`` run the real capture (on a lent GPU, ``.ci/device_check.sh``), against eager
PyTorch and against the same program with graphs off.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.kernels.host_io import stream_cursors
from ipuxl.device.cuda_graphs import GraphedRuns, _DeviceOnly, _NotReplayable, enabled, host_reads

F32 = ipuxl.float32
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Recorded:
    """A stand-in graph: captures nothing at capture (as CUDA records instead of running),
    runs the recorded work at each replay."""

    def __init__(self, work, stream):
        self.work = work

    def replay(self):
        self.work()


class KernelsOnly:
    """A stand-in graph closer to CUDA's: a replay runs the program's kernels on the static
    buffers and none of the session's Python around them (``Session._execute``'s bookkeeping)."""

    def __init__(self):
        self.runs: GraphedRuns | None = None

    def __call__(self, work, stream):
        return self

    def replay(self):
        self.runs.forward(stream_cursors(self.runs._static))


def _accumulator(steps: int):
    """A device loop of ``steps``: ``acc += x * 2`` (x loaded each step), ``acc`` stored."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = steps
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((3,), F32, "x")
        out = ipuxl.d2h_stream((3,), F32, "acc_out")
        acc = ipuxl.variable(np.zeros(3, np.float32), name="acc")

        def step(acc: ipuxl.TensorByRef):
            ops.var_updates.accumulate_(acc, ops.host_load(x_stream) * 2.0)
            ops.host_store(out, acc)

        ops.repeat(ir.create_graph(step, acc), steps, acc)
    return ir, x_stream, acc, out


def _graphed(session: ipuxl.Session, capture=Recorded) -> GraphedRuns:
    """Give a CPU session the runs a CUDA session has (private hooks: the mechanism under test)."""
    session._graphed = GraphedRuns(session.programs[0].forward, lambda f, b: session._execute(f, b, 0), capture)
    return session._graphed


def _runs(session, x_stream, out, data, variable=None):
    """Each run's output (and, given ``variable``, its value read after the run)."""
    results = []
    for x in data:
        results.append(session.run({x_stream: x})[out].copy())
        if variable is not None:
            results.append(session.get_tensor_data(variable).copy())
    return results


def _data(runs: int, steps: int = 3):
    g = np.random.default_rng(0)
    return [g.standard_normal((steps, 3)).astype(np.float32) for _ in range(runs)]


def test_replayed_runs_give_the_compiled_runs_outputs_and_variables():
    data = _data(6)
    ir, x_stream, acc, out = _accumulator(3)
    with ipuxl.Session(ir, "cpu") as plain:
        expected = _runs(plain, x_stream, out, data, acc)  # the variable read after every run
        expected_acc = plain.get_tensor_data(acc).copy()
    ir, x_stream, acc, out = _accumulator(3)
    with ipuxl.Session(ir, "cpu") as session:
        graphed = _graphed(session, kernels := KernelsOnly())
        kernels.runs = graphed
        got = _runs(session, x_stream, out, data, acc)
        assert (graphed.captures, graphed.replays, graphed.reason) == (1, 4, None)  # runs 1-2 warm up, 3 captures
        assert session.steps_completed == (3,)
        got_acc = session.get_tensor_data(acc).copy()
    for g, e in zip(got, expected):
        assert_close(g, e, rtol=0, atol=0)
    assert_close(got_acc, expected_acc, rtol=0, atol=0)


def test_freeing_the_buffers_drops_the_graph_and_captures_again():
    data = _data(9)
    ir, x_stream, acc, out = _accumulator(2)
    with ipuxl.Session(ir, "cpu") as plain:
        expected = _runs(plain, x_stream, out, [d[:2] for d in data])
    ir, x_stream, acc, out = _accumulator(2)
    with ipuxl.Session(ir, "cpu") as session:
        graphed = _graphed(session)
        got = _runs(session, x_stream, out, [d[:2] for d in data[:4]])
        assert graphed.graph is not None
        session.free_buffers()
        assert graphed.graph is None
        got += _runs(session, x_stream, out, [d[:2] for d in data[4:]])
        assert (graphed.captures, graphed.replays) == (2, 2 + 3)
    for g, e in zip(got, expected):
        assert_close(g, e, rtol=0, atol=0)


def test_a_run_that_cannot_be_captured_runs_as_compiled_from_then_on():
    def refuse(work, stream):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    data = _data(5)
    ir, x_stream, acc, out = _accumulator(3)
    with ipuxl.Session(ir, "cpu") as plain:
        expected = _runs(plain, x_stream, out, data)
    ir, x_stream, acc, out = _accumulator(3)
    with ipuxl.Session(ir, "cpu") as session:
        graphed = _graphed(session, refuse)
        got = _runs(session, x_stream, out, data)
        assert graphed.reason == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
        assert (graphed.captures, graphed.replays) == (0, 0)
    for g, e in zip(got, expected):
        assert_close(g, e, rtol=0, atol=0)


def test_another_forward_runs_as_compiled():
    """A profile swaps in a labelled program: it runs as given, never replayed."""
    calls = []
    graphed = GraphedRuns(lambda *a: None, lambda f, b: calls.append(f), Recorded)
    other = object()
    buffers = [torch.zeros(2)]
    for _ in range(4):
        assert graphed.run(other, buffers, [True]) is buffers
    assert calls == [other] * 4 and graphed.captures == 0


def test_capture_refuses_host_tensors_and_own_generators():
    host = torch.ones(2)
    with pytest.raises(_NotReplayable, match=r"reads a cpu tensor of shape \(2,\)"):
        with _DeviceOnly("cuda"):
            host.add_(1)
    with pytest.raises(_NotReplayable, match="draws from its own torch.Generator"):
        with _DeviceOnly("cpu"):
            torch.randn(2, generator=torch.Generator().manual_seed(0))
    with _DeviceOnly("cpu"):  # the device's own tensors and the default generator are fine
        torch.randn(2).mul_(2)


def test_capture_refuses_host_reads_and_tensors_made_elsewhere():
    with pytest.raises(_NotReplayable, match="reads a device value on the host"):
        with _DeviceOnly("cpu"):
            torch.ones(2).sum().item()
    with pytest.raises(_NotReplayable, match="makes a tensor on meta"):
        with _DeviceOnly("cpu"):
            torch.zeros(2, device="meta")
    with pytest.raises(_NotReplayable, match="makes a tensor on meta"):
        with _DeviceOnly("cpu"):
            torch.ones(2).to("meta")


def _compiled_modules(session):
    return [session.programs[0], *(c.module for g in session.ir.graphs if (c := session.compiled_graph(g)))]


class Dropping(nn.Module):
    """Dropout, or a draw of ``torch.rand`` (torch's sampler, seeded on the host), in a step."""

    def __init__(self, draw: str = "dropout"):
        super().__init__()
        self.fc, self.draw = nn.Linear(4, 3), draw

    def forward(self, x, y):
        out = self.fc(x)
        out = torch.nn.functional.dropout(out, 0.5) if self.draw == "dropout" else out * torch.rand(out.shape)
        return out, torch.nn.functional.cross_entropy(out, y)


def test_programs_that_read_on_the_host_by_design_are_never_captured():
    """The scan runs before any capture: a failed capture would run their Python side effects."""
    model = Dropping("rand")
    ipu = ipuxl.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ipu(torch.randn(4, 4), torch.randint(0, 3, (4,)))
    reason = host_reads(_compiled_modules(ipu.session))
    assert reason is not None and "reads on the host" in reason and "random_fill" in reason, reason

    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.ones(3, np.float32), name="x")
        ops.print_tensor(x * 2.0, "doubled")
    with ipuxl.Session(ir, "cpu") as session:
        reason = host_reads(_compiled_modules(session))
    assert reason is not None and "print" in reason, reason

    ir, *_ = _accumulator(2)
    with ipuxl.Session(ir, "cpu") as session:
        assert host_reads(_compiled_modules(session)) is None


def test_dropout_programs_draw_on_the_device():
    """Dropout masks and the seed's updates are counter-based: the scan finds no host-reading
    kernel in the step, so a CUDA session tries a capture (off the CPU they are tensor ops on the
    seed's device, checked against the CPU's numpy path in ``tests/kernels/test_counter_random.py``;
    the CPU's path reads the seed words on the host, where they are), and the step draws from no
    ``torch.Generator`` (``_DeviceOnly`` refuses one, as a capture does; the generator-seeded masks
    before this were refused here)."""
    model = Dropping("dropout")
    ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(2),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    ipu(x, y)
    assert host_reads(_compiled_modules(ipu.session)) is None
    runs = ipu.session.cuda_graphs
    if runs is None:  # the CPU: nothing is captured, but the step must not draw from a generator either
        with _DeviceOnly("cpu"):
            ipu(x, y)
    else:  # a GPU (PopTorch's default device there): from the third run on, each is one replay
        for _ in range(3):
            ipu(x, y)
        assert runs.replays >= 1 and runs.reason is None


def test_a_refused_program_runs_as_compiled():
    calls = []
    graphed = GraphedRuns(calls.append, lambda f, b: calls.append("run"), Recorded, refused="it prints")
    buffers = [torch.zeros(2)]
    for _ in range(4):
        assert graphed.run(graphed.forward, buffers, [True]) is buffers
    assert calls == ["run"] * 4 and graphed.captures == 0 and graphed.reason == "it prints"


@pytest.mark.parametrize("device, replicas, env, expected", [
    ("cuda", 1, None, True), ("cuda", 1, "1", True), ("cuda", 1, "0", False), ("cuda", 2, None, False),
    ("cpu", 1, "1", False)])
def test_which_sessions_replay_graphs(monkeypatch, device, replicas, env, expected):
    if env is None:
        monkeypatch.delenv("IPUXL_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("IPUXL_CUDA_GRAPHS", env)
    assert enabled(torch.device(device), replicas) is expected


def test_the_reason_is_the_error_that_stopped_the_capture():
    """CUDA ends a failed capture with an error of its own, raised over the op's."""
    def refuse(work, stream):
        try:
            work()
        except Exception:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    ir, x_stream, acc, out = _accumulator(1)
    with ipuxl.Session(ir, "cpu") as session:
        graphed = _graphed(session, lambda work, stream: refuse(lambda: _raise_in(work), stream))
        _runs(session, x_stream, out, [d[0] for d in _data(3, steps=1)])
    assert graphed.reason == "ValueError: an op that cannot be replayed"


def _raise_in(work):
    raise ValueError("an op that cannot be replayed\nsecond line")


def test_cpu_sessions_have_no_graphs():
    ir, *_ = _accumulator(1)
    assert ipuxl.Session(ir, "cpu").cuda_graphs is None


# -- on a GPU ----------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 32), nn.Linear(32, 5)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return out, self.loss(out, y)


def _train_ipuxl(model, calls, iterations, monkeypatch, graphs: bool):  # graphs: IPUXL_CUDA_GRAPHS
    monkeypatch.setenv("IPUXL_CUDA_GRAPHS", "1" if graphs else "0")
    ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(iterations),
                              optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = [ipu(x, y)[1].clone() for x, y in calls]
    ipu.copyWeightsToHost()
    return ipu, losses


def _calls(n, iterations, batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(iterations * batch, 12, generator=g), torch.randint(0, 5, (iterations * batch,), generator=g))
            for _ in range(n)]


@cuda
def test_cuda_training_replays_graphs_and_matches_eager(monkeypatch):
    torch.manual_seed(0)
    base = MLP()
    calls = _calls(6, 3)
    ipu, graphed_losses = _train_ipuxl(graphed_model := copy.deepcopy(base), calls, 3, monkeypatch, True)
    runs = ipu.session.cuda_graphs
    assert runs is not None and runs.reason is None and (runs.captures, runs.replays) == (1, 4)
    _, plain_losses = _train_ipuxl(plain_model := copy.deepcopy(base), calls, 3, monkeypatch, False)
    eager = copy.deepcopy(base).cuda()
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for x, y in calls:
        for xs, ys in zip(x.cuda().split(4), y.cuda().split(4)):
            opt.zero_grad()
            eager(xs, ys)[1].backward()
            opt.step()
    for name, p in eager.named_parameters():
        assert_close(dict(graphed_model.named_parameters())[name].detach().cpu(), p.detach().cpu(),
                     rtol=1e-5, atol=1e-6)
        assert_close(dict(graphed_model.named_parameters())[name].detach().cpu(),
                     dict(plain_model.named_parameters())[name].detach().cpu(), rtol=0, atol=0)
    for g, p in zip(graphed_losses, plain_losses):
        assert_close(g, p, rtol=0, atol=0)


def _sync_warnings(model, iterations, monkeypatch, graphs: bool) -> int:
    calls = _calls(4, iterations)
    monkeypatch.setenv("IPUXL_CUDA_GRAPHS", "1" if graphs else "0")
    ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(iterations),
                              optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in calls[:3]:
        ipu(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ipu(*calls[3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@cuda
@pytest.mark.parametrize("graphs", [True, False], ids=["graphed", "compiled"])
def test_cuda_device_loop_does_not_wait_for_the_gpu_between_steps(monkeypatch, graphs):
    """The host waits for the GPU a fixed number of times per call (staging the inputs,
    reading the outputs back), however many steps the device loop runs."""
    torch.manual_seed(0)
    base = MLP()
    two = _sync_warnings(copy.deepcopy(base), 2, monkeypatch, graphs)
    eight = _sync_warnings(copy.deepcopy(base), 8, monkeypatch, graphs)
    assert two == eight, (two, eight)


@cuda
def test_cuda_host_transfers_in_a_conditional_branch_cannot_be_captured(monkeypatch):
    """A branch that transfers host data takes the run's stream cursors only when taken,
    which the host decides from the flag's value: CUDA refuses that read in a capture."""
    monkeypatch.setenv("IPUXL_CUDA_GRAPHS", "1")

    def build():
        ir = ipuxl.Ir()
        ir.num_host_transfers = 2
        with ir.main_graph:
            x_stream = ipuxl.h2d_stream((3,), F32, "x")
            out = ipuxl.d2h_stream((3,), F32, "picked")
            acc = ipuxl.variable(np.zeros(3, np.float32), name="acc")
            spec = ipuxl.TensorSpec((3,), F32)

            def store_double(v):
                ops.host_store(out, v * 2.0)
                return v * 2.0

            def store_negated(v):
                ops.host_store(out, v * -1.0)
                return v * -1.0

            double, negate = ir.create_graph(store_double, spec), ir.create_graph(store_negated, spec)

            def step(acc: ipuxl.TensorByRef):
                x = ops.host_load(x_stream)
                picked, = ops.conditional(ops.greater(ops.sum(x), 0.0), double, negate, [x], [x])
                ops.var_updates.accumulate_(acc, picked)

            ops.repeat(ir.create_graph(step, acc), 2, acc)
        return ir, x_stream, out, acc

    data = [np.array([[1.0] * 3, [-2.0] * 3], np.float32) * v for v in (1.0, -1.0, 2.0, -3.0, 0.5)]
    results = {}
    for device in ("cpu", "ipu_hw"):
        ir, x_stream, out, acc = build()
        with ipuxl.Session(ir, device) as session:
            results[device] = _runs(session, x_stream, out, data) + [session.get_tensor_data(acc).copy()]
            if device == "ipu_hw":
                assert session.cuda_graphs.reason is not None and session.cuda_graphs.replays == 0
    for g, e in zip(results["ipu_hw"], results["cpu"]):
        assert_close(g, e)


@cuda
def test_cuda_dropout_training_is_graphed_and_replays_the_cpu_masks(monkeypatch):
    """Counter-based masks: the graphed CUDA run drops what ``DropoutReplay`` drops in eager
    PyTorch on the CPU, call after call (the seed variable advancing inside the graph)."""
    from ipuxl.poptorch_compat import DropoutReplay

    class DropMLP(MLP):
        def forward(self, x, y):
            out = self.fc2(torch.nn.functional.dropout(torch.nn.functional.gelu(self.fc1(x)), 0.3))
            return out, self.loss(out, y)

    torch.manual_seed(0)
    base = DropMLP()
    calls = _calls(5, 3)
    monkeypatch.setenv("IPUXL_CUDA_GRAPHS", "1")
    model = copy.deepcopy(base)
    ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(3).randomSeed(9),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in calls:
        ipu(x, y)
    ipu.copyWeightsToHost()
    runs = ipu.session.cuda_graphs
    assert runs is not None and runs.reason is None and runs.replays >= 2, (runs and runs.reason)
    for device in ("cpu", "cuda"):  # the eager side on either device replays the same masks
        eager, replay = copy.deepcopy(base).to(device), DropoutReplay(9)
        opt = torch.optim.SGD(eager.parameters(), lr=0.1)
        for x, y in calls:
            for xs, ys in zip(x.to(device).split(4), y.to(device).split(4)):
                opt.zero_grad()
                with replay.step():
                    eager(xs, ys)[1].backward()
                opt.step()
        for name, p in eager.named_parameters():
            assert_close(dict(model.named_parameters())[name].detach().cpu(), p.detach().cpu(), rtol=1e-4, atol=1e-5)
