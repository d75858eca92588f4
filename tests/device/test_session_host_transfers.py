"""PopXL's host transfers: ``Session.run`` runs the main graph once, and every execution
of ``host_load``/``host_store`` (main graph, called graph, ``ops.repeat`` body) takes or
gives the next of the stream's ``num_host_transfers`` slices.

Eager torch is the oracle: each test replays the same slices in a plain Python loop.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
import ipuxl.transforms as transforms
from ipuxl.errors import AutodiffError, IpuxlError, StreamInputError

F32 = ipuxl.float32


def _data(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _sgd_loop_program(n: int, lr: float = 0.1):
    """``ops.repeat`` of a step that loads x, stores ``x @ w`` and updates ``w -= lr * x^T 1``."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = n
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2, 3), F32, "x")
        y_stream = ipuxl.d2h_stream((2, 4), F32, "y")
        w = ipuxl.variable(_data(3, 4, seed=1), name="w")

        def step(w: ipuxl.TensorByRef):
            with ipuxl.in_sequence():
                x = ops.host_load(x_stream)
                ops.host_store(y_stream, x @ w)
                grad = ops.transpose(x) @ ipuxl.constant(np.ones((2, 4), np.float32))
                ops.scaled_add_(w, grad, b=-lr)

        ops.repeat(ir.create_graph(step, w), n, w)
    return ir, x_stream, y_stream, w


def _eager_sgd(xs: np.ndarray, w0: np.ndarray, lr: float = 0.1):
    w = torch.tensor(w0)
    ys = []
    for x in torch.tensor(xs):
        ys.append(x @ w)
        w = w - lr * (x.T @ torch.ones(2, 4))
    return torch.stack(ys), w


def test_host_io_in_a_repeat_body_takes_one_slice_per_iteration():
    ir, x_stream, y_stream, w = _sgd_loop_program(5)
    xs = _data(5, 2, 3)
    with ipuxl.Session(ir, "cpu") as session:
        assert session.transfers_per_run == {x_stream: 5, y_stream: 5}
        ys = session.run({x_stream: xs})[y_stream]
        ys_2 = session.run({x_stream: xs[::-1].copy()})[y_stream]
        w_end = session.get_tensor_data(w)
    want_ys, want_w = _eager_sgd(xs, _data(3, 4, seed=1))
    assert_close(torch.tensor(ys), want_ys, rtol=1e-5, atol=1e-5)
    want_ys_2, want_w_2 = _eager_sgd(xs[::-1].copy(), want_w.numpy())
    assert_close(torch.tensor(ys_2), want_ys_2, rtol=1e-5, atol=1e-5)
    assert_close(torch.tensor(w_end), want_w_2, rtol=1e-5, atol=1e-5)


def test_the_loop_body_reads_its_cursor_in_generated_code():
    ir, x_stream, _, _ = _sgd_loop_program(3)
    with ipuxl.Session(ir, "cpu") as session:
        body = session.compiled_graph(ir.graphs[-1]).module.code
    assert body.count("next(ipuxl_host_io") + body.count("= ipuxl_host_io[") >= 2  # a cursor per transfer
    assert "ipuxl_compiled_repeat" in session.code and "for " not in session.code


def test_host_io_in_a_called_subgraph_and_in_the_main_graph_keeps_program_order():
    """main: a = load(x); call g (loads x, stores it); b = load(x): slices 0, 1, 2."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = 3
    with ir.main_graph, ipuxl.in_sequence():
        x_stream = ipuxl.h2d_stream((4,), F32, "x")
        out_stream = ipuxl.d2h_stream((4,), F32, "out")

        def g(scale):
            ops.host_store(out_stream, ops.host_load(x_stream) * scale)

        graph = ir.create_graph(g, ipuxl.TensorSpec((), F32))
        a = ops.host_load(x_stream)
        ops.call(graph, ipuxl.constant(np.float32(10)))
        b = ops.host_load(x_stream)
        ops.host_store(out_stream, a + b)
        ops.host_store(out_stream, a - b)
    xs = _data(3, 4)
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run({x_stream: xs})[out_stream]
    x = torch.tensor(xs)
    assert_close(torch.tensor(out), torch.stack([10 * x[1], x[0] + x[2], x[0] - x[2]]))


def test_a_graph_called_from_two_sites_takes_a_slice_at_each():
    ir = ipuxl.Ir()
    ir.num_host_transfers = 4
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2,), F32, "x")
        y_stream = ipuxl.d2h_stream((2,), F32, "y")
        graph = ir.create_graph(lambda: ops.host_store(y_stream, ops.host_load(x_stream) * 2.0))
        for _ in range(2):
            ops.call(graph)
        ops.repeat(graph, 2)
    xs = _data(4, 2)
    with ipuxl.Session(ir, "cpu") as session:
        assert session.compiled_graph(graph) is not None  # three sites: compiled once, not inlined
        ys = session.run({x_stream: xs})[y_stream]
    assert_close(ys, xs * 2)


def test_nested_loops_with_host_io_take_count_times_count_slices():
    ir = ipuxl.Ir()
    ir.num_host_transfers = 6
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((3,), F32, "x")
        sum_stream = ipuxl.d2h_stream((3,), F32, "sums")

        def inner(total):
            total = total + ops.host_load(x_stream)
            ops.host_store(sum_stream, total)
            return total

        inner_graph = ir.create_graph(inner, ipuxl.TensorSpec((3,), F32))

        def outer(total):
            return ops.repeat(inner_graph, 3, total)[0] * 2.0

        outer_graph = ir.create_graph(outer, ipuxl.TensorSpec((3,), F32))
        ops.repeat(outer_graph, 2, ipuxl.constant(np.zeros(3, np.float32)))
    xs = _data(6, 3)
    with ipuxl.Session(ir, "cpu") as session:
        sums = session.run({x_stream: xs})[sum_stream]
    want, total = [], np.zeros(3, np.float32)
    for outer_step in range(2):
        for x in xs[3 * outer_step:3 * outer_step + 3]:
            total = total + x
            want.append(total)
        total = total * 2
    assert_close(sums, np.stack(want), rtol=1e-5, atol=1e-5)


def test_several_loads_of_one_stream_in_the_main_graph_accumulate_gradients():
    """Gradient accumulation as PopXL writes it: G unrolled loads, one update."""
    g_steps, lr = 3, 0.05
    ir = ipuxl.Ir()
    ir.num_host_transfers = g_steps
    w0 = _data(3, 2, seed=2)
    with ir.main_graph, ipuxl.in_sequence():
        x_stream = ipuxl.h2d_stream((4, 3), F32, "x")
        w = ipuxl.variable(w0, name="w")
        fwd = ir.create_graph(lambda x, w: ops.sum(ops.gelu(x @ w)), x_stream.spec, w)
        grad_info = transforms.autodiff(fwd)
        total = None
        for _ in range(g_steps):
            info = ops.call_with_info(fwd, ops.host_load(x_stream), w)
            _, dw = ops.call(grad_info.graph, ipuxl.constant(np.float32(1)), inputs_dict=grad_info.inputs_dict(info))
            total = dw if total is None else total + dw
        ops.scaled_add_(w, total, b=-lr / g_steps)
    xs = _data(g_steps, 4, 3)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({x_stream: xs})
        w_end = session.get_tensor_data(w)
    w_t = torch.tensor(w0, requires_grad=True)
    loss = sum(torch.nn.functional.gelu(x @ w_t).sum() for x in torch.tensor(xs))
    loss.backward()
    # float32 gradients summed in another order than eager's: 1e-4
    assert_close(torch.tensor(w_end), (w_t - lr / g_steps * w_t.grad).detach(), rtol=1e-4, atol=1e-4)


def _replicated_accumulation(replicas: int, g_steps: int, lr: float):
    """The shape of PopXL's data-parallel MNIST: G unrolled loads per replica, gradients
    all-reduced (mean) across replicas, one SGD update."""
    ir = ipuxl.Ir(replication=replicas)
    ir.num_host_transfers = g_steps
    with ir.main_graph, ipuxl.in_sequence():
        x_stream = ipuxl.h2d_stream((2, 3), F32, "x")
        loss_stream = ipuxl.d2h_stream((), F32, "loss")
        w = ipuxl.variable(_data(3, 2, seed=3), name="w")
        fwd = ir.create_graph(lambda x, w: ops.sum(ops.tanh(x @ w)), x_stream.spec, w)
        grad_info = transforms.autodiff(fwd, grads_required=fwd.inputs[1:])
        total = None
        for _ in range(g_steps):
            info = ops.call_with_info(fwd, ops.host_load(x_stream), w)
            ops.host_store(loss_stream, info.outputs[0])
            dw, = ops.call(grad_info.graph, ipuxl.constant(np.float32(1)), inputs_dict=grad_info.inputs_dict(info))
            total = dw if total is None else total + dw
        total = ops.collectives.replicated_all_reduce(total, "mean")
        ops.scaled_add_(w, total, b=-lr)
    return ir, x_stream, loss_stream, w


def test_unrolled_loads_with_replication_match_an_eager_loop_over_replicas():
    replicas, g_steps, lr = 2, 3, 0.1
    ir, x_stream, loss_stream, w = _replicated_accumulation(replicas, g_steps, lr)
    xs = _data(g_steps, replicas, 2, 3)
    with ipuxl.Session(ir, "cpu") as session:
        losses = session.run({x_stream: xs})[loss_stream]
        w_end = session.get_tensor_data(w)
    w_t = torch.tensor(_data(3, 2, seed=3), requires_grad=True)
    per_step = torch.stack([torch.stack([torch.tanh(x @ w_t).sum() for x in step]) for step in torch.tensor(xs)])
    per_step.sum().backward()
    assert losses.shape == (g_steps, replicas)
    assert_close(torch.tensor(losses), per_step.detach(), rtol=1e-5, atol=1e-5)
    assert_close(torch.tensor(w_end), (w_t - lr * w_t.grad / replicas).detach(), rtol=1e-5, atol=1e-5)


def test_a_device_loop_with_replication_gives_each_replica_its_slices():
    replicas, n = 2, 4
    ir = ipuxl.Ir(replication=replicas)
    ir.num_host_transfers = n
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((3,), F32, "x")
        y_stream = ipuxl.d2h_stream((3,), F32, "y")
        acc = ipuxl.variable(np.zeros(3, np.float32), name="acc")

        def step(acc: ipuxl.TensorByRef):
            with ipuxl.in_sequence():
                ops.var_updates.accumulate_(acc, ops.host_load(x_stream))
                ops.host_store(y_stream, ops.collectives.replicated_all_reduce(acc))

        ops.repeat(ir.create_graph(step, acc), n, acc)
    xs = _data(n, replicas, 3)
    with ipuxl.Session(ir, "cpu") as session:
        ys = session.run({x_stream: xs})[y_stream]
    total = np.cumsum(xs, 0).sum(1)  # (n, 3): the sum over replicas of each replica's running sum
    assert_close(ys, np.repeat(total[:, None], replicas, axis=1), rtol=1e-5, atol=1e-5)


# -- a program that transfers a stream another number of times than num_host_transfers ---------
def test_a_stream_loaded_fewer_times_than_num_host_transfers_uses_its_first_slices(caplog):
    """As PopART's step IO: 3 loads per run with num_host_transfers 5 read slices 0-2 of
    each run's data; the 2 stored slices no op fills stay zero; no stream takes all 5
    transfers, so it is logged."""
    ir, x_stream, y_stream, w = _sgd_loop_program(3)
    ir.num_host_transfers = 5
    xs = _data(5, 2, 3)
    with caplog.at_level(logging.WARNING, logger="ipuxl"), ipuxl.Session(ir, "cpu") as session:
        ys = session.run({x_stream: xs})[y_stream]
        w_end = session.get_tensor_data(w)
    want_ys, want_w = _eager_sgd(xs[:3], _data(3, 4, seed=1))
    assert_close(torch.tensor(ys[:3]), want_ys, rtol=1e-5, atol=1e-5)
    assert_close(torch.tensor(ys[3:]), torch.zeros(2, 2, 4))
    assert_close(torch.tensor(w_end), want_w, rtol=1e-5, atol=1e-5)
    assert "no stream is transferred 5 times per run ('x' 3, 'y' 3)" in caplog.text


def test_a_per_run_stream_beside_per_step_streams_is_not_logged(caplog):
    """A learning rate loaded once per run while the batches take every transfer (Graphcore's
    applications): the rate reads slice 0, the batches all 4, and nothing is logged."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = 4
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((3,), F32, "x")
        lr_stream = ipuxl.h2d_stream((), F32, "lr")
        y_stream = ipuxl.d2h_stream((3,), F32, "y")
        lr = ops.host_load(lr_stream)
        step = ir.create_graph(lambda lr: ops.host_store(y_stream, ops.host_load(x_stream) * lr), lr)
        ops.repeat(step, 4, lr)
    xs = _data(4, 3)
    with caplog.at_level(logging.WARNING, logger="ipuxl"), ipuxl.Session(ir, "cpu") as session:
        ys = session.run({x_stream: xs, lr_stream: np.array([2.0, 9.0, 9.0, 9.0], np.float32)})[y_stream]
    assert_close(ys, xs * 2.0)
    assert "no stream is transferred" not in caplog.text


def test_storing_a_stream_more_times_than_num_host_transfers_is_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        y_stream = ipuxl.d2h_stream((2,), F32, "y")
        v = ipuxl.variable(np.ones(2, np.float32), name="v")
        ops.host_store(y_stream, v)
        ops.host_store(y_stream, v + 1.0)
    with ipuxl.Session(ir, "cpu") as session:
        with pytest.raises(StreamInputError, match=r"stream 'y' is stored 2 time\(s\) per run .* "
                                                   r"ir.num_host_transfers is 1") as info:
            session.run()
        assert "host_store" in info.value.fix
    ir.num_host_transfers = 2
    with ipuxl.Session(ir, "cpu") as session:
        assert_close(session.run()[y_stream], np.array([[1, 1], [2, 2]], np.float32))


def test_a_program_without_host_io_runs_once_per_run():
    ir = ipuxl.Ir()
    ir.num_host_transfers = 4  # no stream: nothing to check, the main graph still runs once
    with ir.main_graph:
        v = ipuxl.variable(np.zeros(2, np.float32), name="v")
        ops.var_updates.accumulate_(v, ipuxl.constant(np.ones(2, np.float32)))
    with ipuxl.Session(ir, "cpu") as session:
        assert session.run() == {}
        session.run()
        assert_close(session.get_tensor_data(v), np.full(2, 2, np.float32))
        assert "ipuxl_host_io" not in session.code


def test_a_loaded_tensor_written_in_place_in_the_loop_never_writes_the_callers_data():
    ir = ipuxl.Ir()
    ir.num_host_transfers = 3
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2,), F32, "x")
        y_stream = ipuxl.d2h_stream((2,), F32, "y")

        def step():
            x = ops.host_load(x_stream)
            ops.host_store(y_stream, ops.var_updates.accumulate_(x, ipuxl.constant(np.ones(2, np.float32))))

        ops.repeat(ir.create_graph(step), 3)
    xs = _data(3, 2)
    before = xs.copy()
    with ipuxl.Session(ir, "cpu") as session:
        ys = session.run({x_stream: xs})[y_stream]
    assert_close(ys, before + 1)
    assert_close(xs, before)


def test_autodiff_of_a_graph_that_loads_host_data_is_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2,), F32, "x")
        graph = ir.create_graph(lambda w: ops.host_load(x_stream) * w, ipuxl.TensorSpec((2,), F32))
    with pytest.raises(AutodiffError, match="host transfers"):
        transforms.autodiff(graph)
    outer = ir.create_graph(lambda w: ops.call(graph, w)[0] * 2.0, ipuxl.TensorSpec((2,), F32))
    with pytest.raises(IpuxlError, match="stream 'x'"):  # through a call: named too
        transforms.autodiff(outer)


def test_the_poptorch_front_end_builds_its_device_loop_as_a_repeat():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3))
    loss_fn = torch.nn.MSELoss()

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x, t):
            out = self.model(x)
            return out, loss_fn(out, t)

    eager = WithLoss()
    reference = {k: v.clone() for k, v in eager.state_dict().items()}
    training = ipuxl.trainingModel(eager, ipuxl.Options().deviceIterations(4).anchorMode(ipuxl.AnchorMode.All),
                                   optimizer=torch.optim.SGD(eager.parameters(), lr=0.1))
    x, t = torch.randn(4 * 2, 5), torch.randn(4 * 2, 3)
    _, losses = training(x, t)
    report = training.report()
    assert report.graph("main_graph").op_counts == {"repeat": 1}
    body = next(g for g in report.graphs if g.compiled_as == "loop body")
    assert body.op_counts["host_load"] == 2 and body.call_sites[0].count == 4

    replay = WithLoss()
    replay.load_state_dict(reference)
    opt = torch.optim.SGD(replay.parameters(), lr=0.1)
    want = []
    for xb, tb in zip(x.split(2), t.split(2)):
        opt.zero_grad()
        loss = replay(xb, tb)[1]
        loss.backward()
        opt.step()
        want.append(loss.detach())
    assert_close(torch.as_tensor(losses).reshape(-1), torch.stack(want), rtol=1e-5, atol=1e-6)
    training.detachFromDevice()
    assert_close(model[0].weight.detach(), replay.model[0].weight.detach(), rtol=1e-5, atol=1e-6)


def test_full_input_shape_is_popxls_host_data_shape():
    """PopXL's ``Session._full_input_shape``, which Graphcore's programs call."""
    ir, x_stream, _, _ = _replicated_accumulation(2, 3, 0.1)
    with ipuxl.Session(ir, "cpu") as session:
        shape = session._full_input_shape(x_stream.shape)
        assert shape == (3, 2, 2, 3)
        session.run({x_stream: np.ones(shape, np.float32)})
    single, x_single, _, _ = _sgd_loop_program(1)
    assert ipuxl.Session(single, "cpu")._full_input_shape(x_single.shape) == (2, 3)
