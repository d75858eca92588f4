"""``ipuxl.Session``: attach/detach, weight sync, host transfers, calls and repeats.

Eager PyTorch (or a plain Python loop over torch tensors) is the oracle for every
number a program computes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import DetachedError, StreamInputError

F32 = ipuxl.float32


def _ones(shape) -> ipuxl.Tensor:
    return ipuxl.constant(np.ones(shape, np.float32), name="ones")


def _accumulator(num_host_transfers: int = 1, shape: tuple[int, ...] = (2,)):
    """A device loop of ``num_host_transfers`` steps: ``acc += x`` (x loaded each step);
    stores the running ``acc`` and ``acc * 2 + x``."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = num_host_transfers
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream(shape, F32, "x")
        running = ipuxl.d2h_stream(shape, F32, "running")
        y_stream = ipuxl.d2h_stream(shape, F32, "y")
        acc = ipuxl.variable(np.zeros(shape, np.float32), name="acc")

        def step(acc: ipuxl.TensorByRef):
            x = ops.host_load(x_stream)
            ops.var_updates.accumulate_(acc, x)
            ops.host_store(running, acc)
            ops.host_store(y_stream, acc * 2.0 + x)

        ops.repeat(ir.create_graph(step, acc), num_host_transfers, acc)
    return ir, x_stream, acc, running, y_stream


def _counter(num_host_transfers: int = 1):
    """No input streams: a device loop of ``count += 1``, the running count stored."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = num_host_transfers
    with ir.main_graph:
        count = ipuxl.variable(np.zeros((), np.float32), name="count")
        out = ipuxl.d2h_stream((), F32, "count_out")

        def step(count: ipuxl.TensorByRef):
            ops.var_updates.accumulate_(count, ipuxl.constant(np.float32(1.0)))
            ops.host_store(out, count)

        ops.repeat(ir.create_graph(step, count), num_host_transfers, count)
    return ir, count, out


def _x(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# -- attach / detach and weight sync ----------------------------------------------------
def test_with_attaches_and_detaches():
    ir, *_ = _accumulator()
    session = ipuxl.Session(ir, "cpu")
    assert not session.is_attached
    with session as entered:
        assert entered is session
        assert session.is_attached
    assert not session.is_attached


def test_enter_copies_weights_from_host_and_exit_copies_back():
    ir, x_stream, acc, running, _ = _accumulator()
    session = ipuxl.Session(ir)
    initial = np.array([10.0, 20.0], np.float32)
    session.write_variable_data(acc, initial)  # detached: host buffer only
    assert_close(session.get_tensor_data(acc), initial)
    x = _x(2)
    with session:
        out = session.run({x_stream: x})
    assert_close(out[running], initial + x)  # the device started from the written value
    assert_close(session.get_tensor_data(acc), initial + x)  # synced to host on exit


def test_get_tensor_data_inside_context_syncs_after_each_run():
    ir, x_stream, acc, _, _ = _accumulator()
    session = ipuxl.Session(ir)
    x0, x1 = _x(2, seed=0), _x(2, seed=1)
    with session:
        assert_close(session.get_tensor_data(acc), np.zeros(2, np.float32))
        session.run({x_stream: x0})
        assert_close(session.get_tensor_data(acc), x0)
        session.run({x_stream: x1})
        assert_close(session.get_tensors_data([acc])[acc], x0 + x1)


def test_write_variable_data_while_attached_takes_effect_and_keeps_other_weights():
    ir = ipuxl.Ir()
    with ir.main_graph:
        a = ipuxl.variable(np.zeros(2, np.float32), name="a")
        b = ipuxl.variable(np.zeros(2, np.float32), name="b")
        ops.var_updates.accumulate_(a, _ones(2))
        ops.var_updates.accumulate_(b, _ones(2))
        out = ipuxl.d2h_stream((2,), F32, "a_plus_b")
        ops.host_store(out, a + b)
    session = ipuxl.Session(ir)
    with session:
        session.run()  # a = b = 1 on the device; host copies are stale
        session.write_variable_data(a, np.full(2, 5.0, np.float32))
        result = session.run()  # a = 6, b = 2: b kept its device value
        assert_close(result[out], np.full(2, 8.0, np.float32))
        session.write_variables_data({a: np.zeros(2, np.float32), b: np.full(2, -1.0, np.float32)})
        assert_close(session.run()[out], np.full(2, 1.0, np.float32))
    assert_close(session.get_tensor_data(a), np.ones(2, np.float32))
    assert_close(session.get_tensor_data(b), np.zeros(2, np.float32))


def test_write_variable_data_accepts_python_number_for_scalar():
    ir, count, out = _counter()
    session = ipuxl.Session(ir)
    session.write_variable_data(count, 41.0)
    with session:
        assert_close(session.run()[out], np.array(42.0, np.float32))


def test_nested_with_syncs_only_on_outermost_exit():
    ir, count, out = _counter()
    session = ipuxl.Session(ir)
    with session:
        session.run()
        with session:
            assert session.is_attached
            session.run()
        assert session.is_attached  # the inner exit does not detach
        assert_close(session.run()[out], np.array(3.0, np.float32))
    assert not session.is_attached
    assert_close(session.get_tensor_data(count), np.array(3.0, np.float32))
    with session:  # re-attaching restores the host weights on the device
        assert_close(session.run()[out], np.array(4.0, np.float32))


def test_exception_inside_with_detaches_without_syncing_weights():
    ir, count, _ = _counter()
    session = ipuxl.Session(ir)
    with pytest.raises(KeyError):
        with session:
            session.run()
            raise KeyError("boom")
    assert not session.is_attached
    assert_close(session.get_tensor_data(count), np.array(0.0, np.float32))


def test_runtime_functions_need_attached_session():
    ir, x_stream, _, running, _ = _accumulator()
    session = ipuxl.Session(ir)
    for call in (lambda: session.run({x_stream: _x(2)}),
                 lambda: session.run_with_outputs({x_stream: _x(2)}, session.create_host_outputs()),
                 session.weights_to_host, session.weights_from_host):
        with pytest.raises(DetachedError, match="attached"):
            call()


# -- run: outputs, host transfers, input conversion ---------------------------------------
def test_run_returns_stored_streams_as_numpy():
    ir, x_stream, _, running, y_stream = _accumulator()
    x = _x(2)
    with ipuxl.Session(ir) as session:
        assert session.expected_inputs() == [x_stream]
        out = session.run({x_stream: x})
    assert set(out) == {running, y_stream}
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 and v.shape == (2,) for v in out.values())
    xt = torch.from_numpy(x)
    assert_close(out[running], x)
    assert_close(out[y_stream], (xt * 2 + xt).numpy())


@pytest.mark.parametrize("n", [1, 4])
def test_num_host_transfers_stacks_steps_like_eager(n):
    ir, x_stream, acc, running, y_stream = _accumulator(n, shape=(3,))
    xs = _x(n, 3) if n > 1 else _x(3)
    with ipuxl.Session(ir) as session:
        out = session.run({x_stream: xs})
    expected_shape = (n, 3) if n > 1 else (3,)
    assert out[running].shape == expected_shape and out[y_stream].shape == expected_shape

    eager_acc = torch.zeros(3)
    steps = torch.from_numpy(xs).reshape(n, 3)
    for i, x in enumerate(steps):
        eager_acc += x
        assert_close(out[running].reshape(n, 3)[i], eager_acc.numpy())
        assert_close(out[y_stream].reshape(n, 3)[i], (eager_acc * 2 + x).numpy())
    assert_close(session.get_tensor_data(acc), eager_acc.numpy())


def test_num_host_transfers_without_input_streams():
    ir, count, out = _counter(num_host_transfers=3)
    with ipuxl.Session(ir) as session:
        assert_close(session.run()[out], np.array([1.0, 2.0, 3.0], np.float32))
        assert_close(session.run()[out], np.array([4.0, 5.0, 6.0], np.float32))
    assert_close(session.get_tensor_data(count), np.array(6.0, np.float32))


def test_num_host_transfers_input_needs_leading_dim():
    ir, x_stream, *_ = _accumulator(4, shape=(3,))
    with ipuxl.Session(ir) as session:
        with pytest.raises(StreamInputError, match=r"expects shape \(4, 3\).*got \(3,\)"):
            session.run({x_stream: _x(3)})


def test_run_with_outputs_fills_given_arrays():
    ir, x_stream, _, running, y_stream = _accumulator(2)
    xs = _x(2, 2)
    with ipuxl.Session(ir) as session:
        outputs = session.create_host_outputs()
        assert {s: a.shape for s, a in outputs.items()} == {running: (2, 2), y_stream: (2, 2)}
        assert session.run_with_outputs({x_stream: xs}, outputs) is None
    cumulative = np.cumsum(xs, axis=0)
    assert_close(outputs[running], cumulative)
    assert_close(outputs[y_stream], cumulative * 2 + xs)


def test_inputs_may_be_numpy_or_torch():
    ir, x_stream, _, running, y_stream = _accumulator()
    x = _x(2)
    with ipuxl.Session(ir) as session:
        from_numpy = session.run({x_stream: x})
        session.write_variable_data(ir.variables[0], np.zeros(2, np.float32))
        from_torch = session.run({x_stream: torch.from_numpy(x.copy())})
    for stream in (running, y_stream):
        assert_close(from_torch[stream], from_numpy[stream])


def test_in_place_update_of_loaded_tensor_leaves_caller_data_alone():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2,), F32, "x")
        x = ops.host_load(x_stream)
        ops.var_updates.accumulate_(x, _ones(2))
        out = ipuxl.d2h_stream((2,), F32, "out")
        ops.host_store(out, x)
    array, tensor = np.zeros(2, np.float32), torch.zeros(2)
    with ipuxl.Session(ir) as session:
        assert_close(session.run({x_stream: array})[out], np.ones(2, np.float32))
        assert_close(session.run({x_stream: tensor})[out], np.ones(2, np.float32))
    assert_close(array, np.zeros(2, np.float32))
    assert_close(tensor, torch.zeros(2))


def test_scalar_stream_accepts_zero_dim_inputs():
    ir = ipuxl.Ir()
    with ir.main_graph:
        s = ipuxl.h2d_stream((), F32, "s")
        out = ipuxl.d2h_stream((), F32, "out")
        ops.host_store(out, ops.host_load(s) * 3.0)
    with ipuxl.Session(ir) as session:
        for value in (np.array(2.0, np.float32), np.float32(2.0), torch.tensor(2.0), 2.0):
            result = session.run({s: value})[out]
            assert result.shape == ()
            assert_close(result, np.array(6.0, np.float32))


def test_64_bit_inputs_are_downcast():
    ir = ipuxl.Ir()
    with ir.main_graph:
        f_stream = ipuxl.h2d_stream((3,), ipuxl.float32, "f")
        i_stream = ipuxl.h2d_stream((3,), ipuxl.int32, "i")
        total = ops.host_load(f_stream) + ops.cast(ops.host_load(i_stream), ipuxl.float32)
        out = ipuxl.d2h_stream((3,), ipuxl.float32, "out")
        ops.host_store(out, total)
    f64 = np.array([0.5, 1.5, 2.5])
    i64 = np.array([1, 2, 3])
    assert f64.dtype == np.float64 and i64.dtype == np.int64
    with ipuxl.Session(ir) as session:
        result = session.run({f_stream: f64, i_stream: i64})[out]
        assert result.dtype == np.float32
        assert_close(result, (torch.tensor(f64) + torch.tensor(i64)).float().numpy())
        assert_close(session.run({f_stream: torch.tensor(f64), i_stream: torch.tensor(i64)})[out], result)
        with pytest.raises(StreamInputError, match="'f' expects dtype float32, got float64"):
            session.run({f_stream: f64, i_stream: i64.astype(np.int32)}, downcast_inputs=False)


@pytest.mark.parametrize("device", ["ipu_hw", "ipu_model"])
def test_other_device_types_run(device):
    results = {}
    for kind in ("cpu", device):
        ir, x_stream, _, running, y_stream = _accumulator(2)
        with ipuxl.Session(ir, kind) as session:
            out = session.run({x_stream: _x(2, 2)})
        results[kind] = (out[running], out[y_stream])
        assert all(isinstance(a, np.ndarray) for a in results[kind])
    expected_device = "cuda" if device == "ipu_hw" and torch.cuda.is_available() else "cpu"
    assert session.device.type == expected_device
    assert_close(results[device], results["cpu"])


# -- host_store and program order --------------------------------------------------------
def test_host_store_captures_value_at_its_point_in_program_order():
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable(np.array([1.0, 2.0], np.float32), name="v")
        before = ipuxl.d2h_stream((2,), F32, "before")
        ops.host_store(before, v)
        ops.var_updates.accumulate_(v, _ones(2), f=10.0)
        after = ipuxl.d2h_stream((2,), F32, "after")
        ops.host_store(after, v)
        ops.var_updates.accumulate_(v, _ones(2))  # after the last store
    with ipuxl.Session(ir) as session:
        out = session.run()
    assert_close(out[before], np.array([1.0, 2.0], np.float32))
    assert_close(out[after], np.array([11.0, 12.0], np.float32))
    assert_close(session.get_tensor_data(v), np.array([12.0, 13.0], np.float32))


# -- subgraphs: call and repeat ------------------------------------------------------------
def test_subgraph_called_from_two_sites():
    rng = np.random.default_rng(0)
    w_np, a_np, b_np = (rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (2, 3), (2, 3)])
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(w_np, name="w")
        a = ipuxl.constant(a_np, name="a")
        b = ipuxl.constant(b_np, name="b")

        def layer(x, weight):
            return ops.relu(x @ weight) + 1.0

        graph = ir.create_graph(layer, a, w)
        ya, = ops.call(graph, a, w)
        yb, = ops.call(graph, b, inputs_dict={graph.inputs[1]: w})
        streams = [ipuxl.d2h_stream(t.shape, t.dtype, n) for t, n in ((ya, "ya"), (yb, "yb"))]
        for s, t in zip(streams, (ya, yb)):
            ops.host_store(s, t)
    with ipuxl.Session(ir) as session:
        out = session.run()
    wt = torch.from_numpy(w_np)
    assert_close(out[streams[0]], (torch.relu(torch.from_numpy(a_np) @ wt) + 1).numpy())
    assert_close(out[streams[1]], (torch.relu(torch.from_numpy(b_np) @ wt) + 1).numpy())


def _repeat_program(count: int):
    """Loop body ``(x, s), c -> (x * 0.5 + s * c, s + 1)``: x and s carried, c constant."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x0 = ipuxl.constant(np.array([1.0, -2.0], np.float32), name="x0")
        s0 = ipuxl.constant(np.array(3.0, np.float32), name="s0")
        c = ipuxl.constant(np.array([0.25, 2.0], np.float32), name="c")

        def body(x, s, c):
            return x * 0.5 + s * c, s + 1.0

        graph = ir.create_graph(body, x0, s0, c)
        x, s = ops.repeat(graph, count, x0, s0, c)
        streams = (ipuxl.d2h_stream(x.shape, x.dtype, "x"), ipuxl.d2h_stream(s.shape, s.dtype, "s"))
        ops.host_store(streams[0], x)
        ops.host_store(streams[1], s)
    with ipuxl.Session(ir) as session:
        out = session.run()
    return out[streams[0]], out[streams[1]]


@pytest.mark.parametrize("count", [0, 1, 5])
def test_repeat_matches_python_loop(count):
    x, s = torch.tensor([1.0, -2.0]), torch.tensor(3.0)
    c = torch.tensor([0.25, 2.0])
    for _ in range(count):
        x, s = x * 0.5 + s * c, s + 1.0
    got_x, got_s = _repeat_program(count)
    assert_close(got_x, x.numpy())
    assert_close(got_s, s.numpy())


def test_repeat_with_graph_input_and_module():
    class AddWeight(ipuxl.Module):
        def build(self, x):
            self.w = ipuxl.graph_input(x.shape, x.dtype, "w")
            return self.w + x, self.w

    ir = ipuxl.Ir()
    with ir.main_graph:
        x0 = ipuxl.variable(np.array([1.0, 2.0], np.float32), name="x0")
        w0 = ipuxl.variable(np.array([0.5, -1.0], np.float32), name="w0")
        module = AddWeight()
        graph = ir.create_graph(module, x0)
        y, w = ops.repeat(graph, 8, x0, inputs_dict={module.w: w0})
        out = ipuxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(out, y)
    with ipuxl.Session(ir) as session:
        result = session.run()[out]
        assert_close(session.get_tensor_data(x0), np.array([1.0, 2.0], np.float32))  # by value
    assert_close(result, np.array([1.0, 2.0], np.float32) + 8 * np.array([0.5, -1.0], np.float32))


# -- by value vs by reference ----------------------------------------------------------
def _modify_input_program(mode: str):
    """A subgraph does ``x += 1`` in place and returns ``x * 2``; main calls it on variable v."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable(np.array([1.0, 2.0], np.float32), name="v")

        def body(x):
            ops.var_updates.accumulate_(x, _ones(2))
            return x * 2.0

        def body_graph_input():
            x = ipuxl.graph_input((2,), F32, "x", by_ref=True)
            return body(x)

        def body_annotated(x: ipuxl.TensorByRef):
            return body(x)

        if mode == "graph_input_by_ref":
            graph = ir.create_graph(body_graph_input)
        elif mode == "TensorByRef":
            graph = ir.create_graph(body, ipuxl.TensorByRef(v))
        elif mode == "TensorByRef_annotation":
            graph = ir.create_graph(body_annotated, v)
        else:
            graph = ir.create_graph(body, v)
        info = ops.call_with_info(graph, v)
        if mode == "set_parent_input_modified":
            info.set_parent_input_modified(v)
        y_stream = ipuxl.d2h_stream((2,), F32, "y")
        ops.host_store(y_stream, info.outputs[0])
        v_stream = ipuxl.d2h_stream((2,), F32, "v_after_call")
        ops.host_store(v_stream, v)
    with ipuxl.Session(ir) as session:
        out = session.run()
    return out[y_stream], out[v_stream], session.get_tensor_data(v)


def test_in_place_update_of_by_value_input_stays_in_subgraph():
    y, v_after, v_host = _modify_input_program("by_value")
    assert_close(y, np.array([4.0, 6.0], np.float32))  # the subgraph saw its own update
    assert_close(v_after, np.array([1.0, 2.0], np.float32))
    assert_close(v_host, np.array([1.0, 2.0], np.float32))


@pytest.mark.parametrize("mode", ["graph_input_by_ref", "TensorByRef", "TensorByRef_annotation",
                                  "set_parent_input_modified"])
def test_in_place_update_of_by_reference_input_reaches_parent(mode):
    y, v_after, v_host = _modify_input_program(mode)
    assert_close(y, np.array([4.0, 6.0], np.float32))
    assert_close(v_after, np.array([2.0, 3.0], np.float32))
    assert_close(v_host, np.array([2.0, 3.0], np.float32))


def test_in_place_update_of_call_output_leaves_input_alone():
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable(np.zeros(2, np.float32), name="v")
        graph = ir.create_graph(lambda x: x, v)
        y, = ops.call(graph, v)
        ops.var_updates.accumulate_(y, _ones(2))
    with ipuxl.Session(ir) as session:
        session.run()
    assert_close(session.get_tensor_data(v), np.zeros(2, np.float32))


def test_inlined_call_output_aliasing_an_input_is_copied_only_when_the_input_changes_under_it():
    """A transposed weight returned by an inlined call stays a view while nothing
    writes the weight before its last read, and becomes a copy when something does."""
    for update_before_read in (False, True):
        ir = ipuxl.Ir()
        with ir.main_graph:
            w = ipuxl.variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="w")
            wt, = ops.call(ir.create_graph(lambda x: x.T, w), w)
            if update_before_read:
                ops.scaled_add_(w, ipuxl.constant(np.ones((2, 3), np.float32)))
            out = ipuxl.d2h_stream((3, 2), F32, "wt")
            ops.host_store(out, wt * 1.0)
            if not update_before_read:
                ops.scaled_add_(w, ipuxl.constant(np.ones((2, 3), np.float32)))
        with ipuxl.Session(ir) as session:
            result = session.run()[out]
        assert_close(result, np.arange(6, dtype=np.float32).reshape(2, 3).T)
        assert ("torch.clone" in session.code) == update_before_read, session.code


def test_in_place_update_of_reshape_output_leaves_source_alone():
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable(np.zeros((2, 2), np.float32), name="v")
        flat = v.reshape((4,))
        ops.var_updates.accumulate_(flat, _ones(4))
    with ipuxl.Session(ir) as session:
        session.run()
    assert_close(session.get_tensor_data(v), np.zeros((2, 2), np.float32))


def test_in_place_update_through_view_of_by_value_input_stays_in_subgraph():
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable(np.zeros((2, 2), np.float32), name="v")

        def body(x):
            flat = x.reshape((4,))
            ops.var_updates.accumulate_(flat, _ones(4))
            return flat

        ops.call(ir.create_graph(body, v), v)
    with ipuxl.Session(ir) as session:
        session.run()
    assert_close(session.get_tensor_data(v), np.zeros((2, 2), np.float32))


# -- two IRs ------------------------------------------------------------------------
def test_weights_copied_between_two_irs():
    rng = np.random.default_rng(0)
    w_init = rng.standard_normal((3, 2)).astype(np.float32)
    x_np = rng.standard_normal((4, 3)).astype(np.float32)

    train_ir = ipuxl.Ir()
    with train_ir.main_graph:
        w_train = ipuxl.variable(w_init, name="w")
        ops.scaled_add_(w_train, ipuxl.constant(np.ones((3, 2), np.float32)), b=-0.1)
    train_session = ipuxl.Session(train_ir)
    with train_session:
        for _ in range(3):
            train_session.run()
    trained = train_session.get_tensors_data([w_train])

    test_ir = ipuxl.Ir()
    with test_ir.main_graph:
        x_stream = ipuxl.h2d_stream((4, 3), F32, "x")
        w_test = ipuxl.variable(np.zeros((3, 2), np.float32), name="w")
        y = ops.host_load(x_stream) @ w_test
        y_stream = ipuxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(y_stream, y)
    test_session = ipuxl.Session(test_ir)
    test_session.write_variables_data({w_test: trained[w_train]})
    with test_session:
        out = test_session.run({x_stream: x_np})[y_stream]
    w_eager = torch.from_numpy(w_init) - 3 * 0.1
    assert_close(out, (torch.from_numpy(x_np) @ w_eager).numpy())


# -- inspection -----------------------------------------------------------------------
def test_print_schedule_mentions_ops_and_called_graphs():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2,), F32, "x_in")
        x = ops.host_load(x_stream)

        def scale(t):
            return ops.tanh(t) * 3.0

        graph = ir.create_graph(scale, x)
        y, = ops.call(graph, x)
        out = ipuxl.d2h_stream((2,), F32, "y_out")
        ops.host_store(out, ops.exp(y))
    main = ir.main_graph.print_schedule()
    assert isinstance(main, str)
    assert main.splitlines()[:2] == ["Graph : main_graph", "  () -> () {"]
    assert "HostLoad.100" in main and "() -> (%1 [(2,) float32])" in main
    for fragment in (f"Call.103({graph.name}) (%1 [(2,) float32])",
                     "Exp.104 (%2 [(2,) float32]) -> (%3 [(2,) float32])", "HostStore.105(y_out) (%3"):
        assert fragment in main, (fragment, main)
    assert graph.print_schedule().splitlines() == [
        f"Graph : {graph.name}",
        "  (%1) -> (%3) {",
        "    Tanh.101 (%1 [(2,) float32]) -> (%2 [(2,) float32])",
        "    Mul.102 (%2 [(2,) float32]) -> (%3 [(2,) float32])",
        "  }",
    ]


def test_view_read_after_its_source_is_updated_keeps_the_old_value():
    """PopXL's reshape/cast/detach/transpose/slice are copies, so they keep the value they saw."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.arange(4, dtype=np.float32).reshape(2, 2), name="x")
        views = [x.reshape((4,)), ops.cast(x, F32), ops.detach(x), x.T, x[0]]
        ops.scaled_add_(x, ipuxl.constant(np.ones((2, 2), np.float32)))
        streams = [ipuxl.d2h_stream(v.shape, v.dtype, f"v{i}") for i, v in enumerate(views)]
        for stream, view in zip(streams, views):
            ops.host_store(stream, view)
    with ipuxl.Session(ir) as session:
        out = session.run()
    before = torch.arange(4, dtype=torch.float32).reshape(2, 2)
    expected = [before.reshape(4), before, before, before.T, before[0]]
    for stream, value in zip(streams, expected):
        assert_close(torch.from_numpy(out[stream]), value)
    assert_close(torch.from_numpy(session.get_tensor_data(x)), before + 1)


def test_storage_given_to_the_session_is_the_variables_device_storage():
    """``Session(storage=...)`` / ``bind_storage`` (what trainingModel binds the module's tensors with)."""
    ir, x_stream, acc, _, _ = _accumulator(num_host_transfers=3)
    mine = torch.full((2,), 5.0)
    with ipuxl.Session(ir, "cpu", storage={acc: mine}) as session:
        assert_close(mine, torch.zeros(2))  # attaching wrote the variable's initial data into it
        session.run({x_stream: np.ones((3, 2), np.float32)})
        assert_close(mine, torch.full((2,), 3.0))  # the program updated it in place
        other = torch.full((2,), 10.0)
        session.bind_storage(acc, other)
        session.run({x_stream: np.ones((3, 2), np.float32)})
        assert_close(other, torch.full((2,), 13.0))
        assert_close(mine, torch.full((2,), 3.0))  # no longer the storage
        assert_close(session.get_tensor_data(acc), np.full(2, 13.0, np.float32))
    with pytest.raises(ipuxl.errors.InvalidArgumentError, match="'acc'.*float64"):
        ipuxl.Session(ir, "cpu", storage={acc: torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(ipuxl.errors.InvalidArgumentError, match="not contiguous"):
        ipuxl.Session(ir, "cpu", storage={acc: torch.zeros(2, 2)[:, 0]})


def test_what_the_session_compiled_is_readable():
    """``num_host_transfers``, ``local_replicas``, ``programs``, ``compiled_graph`` and
    ``steps_completed`` describe what the session compiled and ran (read-only)."""
    ir, x_stream, _, _, _ = _accumulator(num_host_transfers=3)
    with ir.main_graph:
        double = ir.create_graph(lambda x: x * 2.0, ipuxl.TensorSpec((2,), F32))
        once = ir.create_graph(lambda x: x + 1.0, ipuxl.TensorSpec((2,), F32))
        for _ in range(2):
            ops.call(double, _ones((2,)))
        ops.call(once, _ones((2,)))
    with ipuxl.Session(ir, "cpu") as session:
        assert (session.num_host_transfers, session.local_replicas, session.steps_completed) == (3, [0], (0,))
        session.run({x_stream: np.ones((3, 2), np.float32)})
        assert session.steps_completed == (3,)
        assert len(session.programs) == 1 and session.programs[0].code == session.code
        compiled = session.compiled_graph(double)
        assert compiled is not None and session.code.count(f"{compiled.call.__name__}(") == 2  # both sites call it
        assert session.compiled_graph(once) is None  # one call site: inlined into the main program
        ir.num_host_transfers = 5
        assert session.num_host_transfers == 3  # what was compiled, not the IR's new setting
