"""PopXL's Session, remote buffer and context behaviours as upstream has them.

Runtime calls on a detached session are ValueErrors with PopXL's sentence; the data
methods name the tensor types they support; a one-element stream takes a scalar;
remote buffers are numbered per Ir and keep their shape; nested contexts of two Irs
are refused.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import PopartException
from ipuxl.popart_compat import popart_exception


def _accumulating_session() -> tuple[ipuxl.Session, ipuxl.Variable, ipuxl.Constant, ipuxl.Tensor]:
    ir = ipuxl.Ir()
    with ir.main_graph:
        w, c = ipuxl.variable(np.float32(2.0)), ipuxl.constant(np.float32(1.0))
        updated = ops.var_updates.accumulate_(w, c)
    return ipuxl.Session(ir, "cpu"), w, c, updated


@pytest.mark.parametrize("call", [lambda s: s.run(), lambda s: s.run_with_outputs({}, {}),
                                  lambda s: s.weights_from_host(), lambda s: s.weights_to_host()])
def test_runtime_calls_of_a_detached_session_are_value_errors(call):
    session, w, _, _ = _accumulating_session()
    with pytest.raises(ValueError, match="Must be attached to device before calling a runtime function"):
        call(session)
    session.write_variable_data(w, np.float32(3.0))  # the host-side calls need no device
    assert session.get_tensor_data(w) == 3.0


def test_data_methods_name_the_types_they_support():
    session, w, c, updated = _accumulating_session()
    with pytest.raises(TypeError, match="is not of type Constant or Variable. get_tensor_data is not supported"):
        session.get_tensor_data(updated)
    with session, pytest.raises(TypeError, match=f"Tensor {c.id} is not of type Variable. write_variable_data"):
        session.write_variable_data(c, np.float32(1.0))


def test_a_one_element_stream_takes_a_scalar():
    ir = ipuxl.Ir()
    with ir.main_graph:
        flag = ipuxl.h2d_stream([1], ipuxl.bool)
        out = ipuxl.d2h_stream([1], ipuxl.bool)
        ops.host_store(out, ops.logical_not(ops.host_load(flag)))
    with ipuxl.Session(ir, "cpu") as session:
        assert session.run({flag: np.array(True)})[out].tolist() == [False]
    with ipuxl.Session(ir, "cpu") as session, pytest.raises(ValueError, match="expects shape"):
        session.run({flag: np.array([True, False])})


def test_unsigned_variables_accumulate_and_wrap():
    ir = ipuxl.Ir()
    start = np.array([2**32 - 2, 5], np.uint32)
    with ir.main_graph:
        w = ipuxl.variable(start)
        ops.var_updates.accumulate_(w, ipuxl.constant(np.array([3, 4], np.uint32)))
    with ipuxl.Session(ir, "cpu") as session:
        session.run()
    assert session.get_tensor_data(w).tolist() == [1, 9]  # 2**32 - 2 + 3 wraps to 1


def test_scaled_add_of_integer_tensors_takes_whole_float_factors():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.array([1, 2], np.int32))
        ops.scaled_add_(x, ipuxl.constant(np.array([10, 20], np.int32)))
        y = ops.scaled_add(x, ipuxl.constant(np.array([1, 1], np.int32)), a=2.0, b=3.0)
        out = ipuxl.d2h_stream(y.shape, y.dtype)
        ops.host_store(out, y)
    with ipuxl.Session(ir, "cpu") as session:
        assert session.run()[out].tolist() == [25, 47]
    assert session.get_tensor_data(x).tolist() == [11, 22]


@pytest.mark.parametrize("shape", [(3, 3), (2, 4)])
def test_tensor_diag_is_torchs_diagonal_of_a_matrix(shape):
    data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    ir = ipuxl.Ir()
    with ir.main_graph:
        d = ipuxl.variable(data).diag()
        out = ipuxl.d2h_stream(d.shape, d.dtype)
        ops.host_store(out, d)
        for bad in ((4,), (2, 2, 2)):
            with pytest.raises(ValueError, match="2-D"):
                ipuxl.variable(np.zeros(bad, np.float32)).diag()
    with ipuxl.Session(ir, "cpu") as session:
        assert_close(torch.from_numpy(session.run()[out]), torch.from_numpy(data).diag())


def test_remote_buffers_are_numbered_per_ir_and_keep_their_shape_and_dtype():
    buffers = []
    for _ in range(2):
        with ipuxl.Ir().main_graph:
            buffers.append((ipuxl.RemoteBuffer((2,), ipuxl.int8, 1), ipuxl.remote_buffer((2,), ipuxl.int8, 1)))
    assert [(a.remote_buffer_id, b.remote_buffer_id) for a, b in buffers] == [(1, 2), (1, 2)]
    first = buffers[0][0]
    for attribute in ("tensor_shape", "tensor_dtype"):
        with pytest.raises(AttributeError, match="can't set attribute"):
            setattr(first, attribute, (3,))
    with pytest.raises(ValueError, match="Entries must be a non-zero, positive integer"):
        first.entries = 0
    first.set_remote_buffer_info(tensor_dtype=ipuxl.int16, tensor_shape=(3, 1), entries=4)
    assert (first.tensor_shape, first.tensor_dtype, first.entries) == ((3, 1), ipuxl.int16, 4)
    assert first._current_ir is buffers[0][1]._current_ir
    with ipuxl.Ir().main_graph:
        t = ipuxl.variable(np.zeros((2,), np.int8))
        with pytest.raises(ValueError, match="Tensor does not match buffer."):
            ipuxl.remote_buffer((3,), ipuxl.int8).validate_tensor_matches_buffer(t)


def test_a_remote_sharded_variable_records_the_full_shape_on_its_buffer():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        buffer = ipuxl.RemoteBuffer((1,), ipuxl.int32, 2)
        ipuxl.remote_replica_sharded_variable(np.array([1, 2], np.int32), buffer, 0, name="x1")
        ipuxl.remote_replica_sharded_variable(np.array([3, 4], np.int32), buffer, 1, name="x2")
    assert buffer.meta_shape == (2,)


def test_all_replicas_variables_have_one_host_row_per_group():
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        w = ipuxl.variable(np.zeros((2, 3), np.float32), replica_grouping=ir.replica_grouping(stride=1, group_size=2),
                           retrieval_mode="all_replicas")
        buffer = ipuxl.remote_buffer((3,), ipuxl.float32)
        r = ipuxl.remote_variable(np.zeros((2, 3), np.float32), buffer, retrieval_mode="all_replicas",
                                  replica_grouping=ir.replica_grouping(stride=1, group_size=2))
    assert w.shape_on_host == r.shape_on_host == (2, 3)


def test_graph_contexts_of_two_irs_do_not_nest():
    first, second = ipuxl.Ir(), ipuxl.Ir()
    with first.main_graph:
        with pytest.raises(RuntimeError, match="another Ir"):
            with second.main_graph:
                pass
    with second.main_graph:  # the refused entry left the context stack as it was
        assert ipuxl.gcg() is second.main_graph


def test_in_sequence_refuses_none_with_popxls_words():
    with pytest.raises(TypeError, match="`None` cannot be passed to"):
        with ipuxl.in_sequence(None):
            pass


def test_shape_errors_are_popart_exceptions():
    assert popart_exception is PopartException
    with ipuxl.Ir().main_graph:
        x = ipuxl.variable(np.zeros((2, 3), np.float32))
        with pytest.raises(popart_exception, match="Invalid shape value in reshape"):
            x.reshape((6, -2))
        with pytest.raises(popart_exception, match="at most one '-1'"):
            x.reshape((-1, -1))
