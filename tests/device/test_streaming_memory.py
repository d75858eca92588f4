"""Streaming Memory: remote buffers, remote variables, loads and stores against numpy."""
from __future__ import annotations

import numpy as np
import pytest
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import DeviceError, InvalidArgumentError, InvalidValueError, ShapeMismatchError, WrongGraphError

F32 = ipuxl.float32


def _store(t: ipuxl.Tensor, name: str) -> ipuxl.DeviceToHostStream:
    stream = ipuxl.d2h_stream(t.shape, t.dtype, name)
    ops.host_store(stream, t)
    return stream


def test_remote_buffer_has_popxl_attributes():
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2, 3), F32, entries=4)
        other = ipuxl.RemoteBuffer((1,), ipuxl.int32)
    assert (buffer.tensor_shape, buffer.tensor_dtype, buffer.entries, buffer.meta_shape) == ((2, 3), F32, 4, ())
    buffer.entries = 6  # popxl.addons grows buffers before the session exists
    assert buffer.entries == 6
    assert other.remote_buffer_id != buffer.remote_buffer_id and other.entries == 1


def test_loads_and_stores_follow_program_order_and_persist_across_runs():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 0.5, np.float32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2, 3), F32, entries=2)
        va = ipuxl.remote_variable(a, buffer, 0, name="a")
        vb = ipuxl.remote_variable(b, buffer, 1, name="b")
        before = ops.remote_load(buffer, 1)
        ops.remote_store(buffer, 1, ops.remote_load(buffer, 0) + before)
        after = ops.remote_load(buffer, 1)
        s_before, s_after = _store(before, "before"), _store(after, "after")
    with ipuxl.Session(ir, "ipu_model") as session:
        first = session.run()
        second = session.run()
    assert_close(first[s_before], b)
    assert_close(first[s_after], a + b)
    assert_close(second[s_before], a + b)  # Streaming Memory keeps its contents between runs
    assert_close(second[s_after], 2 * a + b)
    assert_close(session.get_tensor_data(vb), 2 * a + b)
    assert_close(session.get_tensor_data(va), a)


def test_write_variable_data_reaches_the_slot():
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((3,), F32, entries=1)
        w = ipuxl.remote_variable(np.zeros(3, np.float32), buffer, 0, name="w")
        out = _store(ops.remote_load(buffer, 0) * 2.0, "out")
    session = ipuxl.Session(ir, "cpu")
    session.write_variable_data(w, np.array([1.0, 2.0, 3.0], np.float32))
    with session:
        assert_close(session.run()[out], np.array([2.0, 4.0, 6.0], np.float32))
        session.write_variable_data(w, np.array([5.0, 5.0, 5.0], np.float32))  # attached: device too
        assert_close(session.run()[out], np.full(3, 10.0, np.float32))
    with pytest.raises(ShapeMismatchError, match="host data has shape"):
        session.write_variable_data(w, np.zeros(4, np.float32))


def test_remote_load_in_place_and_tensor_offsets_in_a_loop():
    """A loop body loads entry ``i`` (a loop counter tensor) into a buffer it accumulates."""
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((3,), F32, entries=4)
        for i in range(4):
            ipuxl.remote_variable(rows[i], buffer, i, name=f"row{i}")
        counter = ipuxl.variable(np.zeros((), np.int32), ipuxl.int32, name="i")
        total = ipuxl.variable(np.zeros(3, np.float32), F32, name="total")

        def body(i: ipuxl.TensorByRef, acc: ipuxl.TensorByRef):
            loaded = ops.init((3,), F32, "slot")
            ops.remote_load_(loaded, buffer, i)
            ops.var_updates.accumulate_(acc, loaded)
            ops.var_updates.accumulate_(i, ipuxl.constant(np.ones((), np.int32), ipuxl.int32))

        ops.repeat(ir.create_graph(body, counter, total), 4, counter, total)
    with ipuxl.Session(ir, "cpu") as session:
        session.run()
    assert_close(session.get_tensor_data(total), rows.sum(0))


def test_loads_and_stores_in_a_called_subgraph():
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2,), F32, entries=1)
        w = ipuxl.remote_variable(np.array([1.0, -1.0], np.float32), buffer, 0, name="w")

        def step(x):
            ops.remote_store(buffer, 0, ops.remote_load(buffer, 0) * x)

        graph = ir.create_graph(step, ipuxl.TensorSpec((2,), F32))
        ops.call(graph, ipuxl.constant(np.array([3.0, 3.0], np.float32)))
        ops.call(graph, ipuxl.constant(np.array([0.5, 2.0], np.float32)))
    with ipuxl.Session(ir, "cpu") as session:
        session.run()
    assert_close(session.get_tensor_data(w), np.array([1.5, -6.0], np.float32))


def test_replicas_each_have_their_own_streaming_memory_and_grouped_host_data():
    """Two groups of two replicas: one value per group; each replica's stores stay its own."""
    ir = ipuxl.Ir(replication=4)
    data = np.array([[1.0, 1.0], [10.0, 10.0]], np.float32)  # one row per group
    with ir.main_graph:
        group = ir.replica_grouping(stride=1, group_size=2)
        buffer = ipuxl.remote_buffer((2,), F32)
        w = ipuxl.remote_variable(data, buffer, 0, name="w", replica_grouping=group)
        x = ops.host_load(ipuxl.h2d_stream((2,), F32, "x"))
        ops.remote_store(buffer, 0, ops.remote_load(buffer, 0) + x)
        out = _store(ops.remote_load(buffer, 0), "out")
    x_stream = ir.get_all_h2d_streams()[0]
    feed = np.arange(8, dtype=np.float32).reshape(4, 2)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run({x_stream: feed})[out]
    expected = data[[0, 0, 1, 1]] + feed
    assert_close(got, expected)
    assert w.shape_on_host == (2, 2)
    assert_close(session.get_tensor_data(w), expected[[0, 2]])  # each group's first replica


def test_all_replicas_retrieval_mode_reads_every_replica():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((1,), F32)
        w = ipuxl.remote_variable(np.zeros(1, np.float32), buffer, 0, retrieval_mode="all_replicas")
        x = ops.host_load(ipuxl.h2d_stream((1,), F32, "x"))
        ops.remote_store(buffer, 0, x)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({ir.get_all_h2d_streams()[0]: np.array([[3.0], [4.0]], np.float32)})
    assert_close(session.get_tensor_data(w), np.array([[3.0], [4.0]], np.float32))


# -- errors ---------------------------------------------------------------------------------------------
def test_bad_offsets_are_refused_when_built():
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2,), F32, entries=2)
        with pytest.raises(InvalidValueError, match=r"offset 2 is out of range .* 2 entries"):
            ops.remote_load(buffer, 2)
        with pytest.raises(InvalidValueError, match="offset -1 is out of range"):
            ops.remote_store(buffer, -1, ipuxl.constant(np.zeros(2, np.float32)))
        with pytest.raises(InvalidValueError, match="one integer"):
            ops.remote_load(buffer, ipuxl.constant(np.zeros(2, np.int32)))
        with pytest.raises(InvalidValueError, match="Entries must be a non-zero, positive integer"):
            ipuxl.remote_buffer((2,), F32, entries=0)


def test_shape_and_dtype_mismatches_are_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2, 3), F32, entries=2)
        with pytest.raises(ShapeMismatchError, match=r"\(3, 2\) float32\) does not match remote buffer"):
            ops.remote_store(buffer, 0, ipuxl.constant(np.zeros((3, 2), np.float32)))
        with pytest.raises(ShapeMismatchError, match="int32"):
            ops.remote_load_(ipuxl.constant(np.zeros((2, 3), np.int32)), buffer, 0)
        with pytest.raises(ShapeMismatchError, match=r"data \(3,\) float32 does not match"):
            ipuxl.remote_variable(np.zeros(3, np.float32), buffer, 0)
        ipuxl.remote_variable(np.zeros((2, 3), np.float32), buffer, 0, name="first")
        with pytest.raises(InvalidValueError, match="already holds remote variable 'first'"):
            ipuxl.remote_variable(np.zeros((2, 3), np.float32), buffer, 0)
        with pytest.raises(InvalidArgumentError, match="needs a RemoteBuffer"):
            ops.remote_load("buffer", 0)


def test_remote_variables_only_in_the_main_graph():
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2,), F32)

    def build():
        ipuxl.remote_variable(np.zeros(2, np.float32), buffer, 0)

    with pytest.raises(WrongGraphError, match="only be created in the main graph"):
        ir.create_graph(build)


def test_a_tensor_offset_out_of_range_fails_the_step_with_the_op_and_line():
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2,), F32, entries=2)
        offset = ops.host_load(ipuxl.h2d_stream((), ipuxl.int32, "offset"))
        out = _store(ops.remote_load(buffer, offset), "out")
    stream = ir.get_all_h2d_streams()[0]
    with ipuxl.Session(ir, "cpu") as session:
        assert session.run({stream: np.array(1, np.int32)})[out].shape == (2,)
        with pytest.raises(DeviceError, match=r"(?s)offset 5 is out of range for remote buffer .* 2 entries") as info:
            session.run({stream: np.array(5, np.int32)})
    assert isinstance(info.value, IndexError)
    assert "test_streaming_memory.py" in str(info.value)


def test_scalar_remote_variables_with_one_value_per_group():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((), F32)
        step = ipuxl.remote_variable(np.array([1.0, 2.0], np.float32), buffer, 0, name="step",
                                     replica_grouping=ir.replica_grouping(group_size=1))
        ops.remote_store(buffer, 0, ops.remote_load(buffer, 0) + 1.0)
    with ipuxl.Session(ir, "cpu") as session:
        session.run()
    assert_close(session.get_tensor_data(step), np.array([2.0, 3.0], np.float32))


@pytest.mark.parametrize("grouping", [None, "one group"])
def test_one_groups_data_may_keep_its_group_axis_of_size_one(grouping):
    """Data built as (num_groups, *shape) for any grouping (PopXL's own grouping tests do) is
    taken for a single group too: the leading axis of size 1 is the group's."""
    ir = ipuxl.Ir(replication=4)
    group = ir.replica_grouping(group_size=4) if grouping else None
    data = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2, 3), F32, entries=1)
        w = ipuxl.remote_variable(data, buffer, 0, name="w", replica_grouping=group)
        ops.remote_store(buffer, 0, ops.remote_load(buffer, 0) + 1.0)
        assert w.shape == (2, 3)
        with pytest.raises(ShapeMismatchError, match=r"data \(2, 2, 3\) float32 does not match"):
            ipuxl.remote_variable(np.zeros((2, 2, 3), np.float32), ipuxl.remote_buffer((2, 3), F32), 0)
    with ipuxl.Session(ir, "cpu") as session:
        session.run()
    assert_close(session.get_tensor_data(w), data[0] + 1.0)


def test_buffers_changed_after_the_session_was_created_are_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2,), F32, entries=1)
        ops.remote_store(buffer, 0, ipuxl.constant(np.ones(2, np.float32)))
    session = ipuxl.Session(ir, "cpu")
    buffer.entries = 3
    with session, pytest.raises(DeviceError, match="remote buffers or remote variables changed"):
        session.run()


def test_a_remote_variable_is_not_an_operand_programs_load_it():
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((3,), F32)
        w = ipuxl.remote_variable(np.ones(3, np.float32), buffer, 0, name="w")
        with pytest.raises(WrongGraphError, match="'w' .* belongs to graph 'streaming_memory'"):
            ops.mul(w, 2.0)
    assert w.remote_buffer is buffer and w.offset == 0 and w.graph.name == "streaming_memory"


def test_all_replicas_retrieval_with_a_grouping_gives_one_row_per_replica():
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((1,), F32)
        w = ipuxl.remote_variable(np.array([[1.0], [2.0]], np.float32), buffer, 0, retrieval_mode="all_replicas",
                                  replica_grouping=ir.replica_grouping(stride=2, group_size=2))
    session = ipuxl.Session(ir, "cpu")
    assert w.shape_on_host == (2, 1)  # PopXL: one row per group; get_tensor_data reads every replica
    assert_close(session.get_tensor_data(w), np.array([[1.0], [2.0], [1.0], [2.0]], np.float32))
