"""Replicated tensor sharding: layouts per replica and grouping, host data, gradients."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl import transforms
from ipuxl.errors import InvalidValueError, UnsupportedError
from ipuxl.ir.remote import shard_grouping

F32 = ipuxl.float32


def groups_of(replicas: int, stride: int, size: int) -> list[list[int]]:
    """PopXL's partition, written independently: members ``stride`` apart, in blocks."""
    groups, seen = [], set()
    for start in range(replicas):
        if start not in seen:
            members = [start + k * stride for k in range(size)]
            seen.update(members)
            groups.append(members)
    return groups


def expected_shard(full: np.ndarray, index: int, shard_over: int) -> np.ndarray:
    flat = full.reshape(-1)
    size = -(-flat.size // shard_over)
    padded = np.concatenate([flat, np.zeros(size * shard_over - flat.size, flat.dtype)])
    return padded[index * size:(index + 1) * size]


def _store(t: ipuxl.Tensor, name: str) -> ipuxl.DeviceToHostStream:
    stream = ipuxl.d2h_stream(t.shape, t.dtype, name)
    ops.host_store(stream, t)
    return stream


# (replicas, (stride, group_size) of the variable's grouping or None, shard_over or None)
LAYOUTS = [(2, None, None), (4, None, None), (4, None, 2), (4, (1, 2), None), (4, (2, 2), None),
           (8, (2, 4), 2), (8, (1, 4), 4), (4, (1, 1), None)]


@pytest.mark.parametrize("replicas, grouping, shard_over", LAYOUTS)
def test_each_replica_holds_its_shard_of_its_groups_value(replicas, grouping, shard_over):
    stride, size = grouping or (1, replicas)
    groups = groups_of(replicas, stride, size)
    over = shard_over or size
    full_shape = (3, 5)  # 15 elements: padded for every shard count > 1 here except 1 and 3
    data = np.arange(len(groups) * 15, dtype=np.float32).reshape(len(groups), *full_shape)
    host = data if len(groups) > 1 else data[0]
    ir = ipuxl.Ir(replication=replicas)
    with ir.main_graph:
        rg = ir.replica_grouping(stride, size) if grouping else None
        host_shape = (len(groups), *full_shape) if len(groups) > 1 else full_shape  # PopXL: with the group dim
        buffer = ipuxl.replica_sharded_buffer(host_shape, F32, replica_grouping=rg, shard_over=shard_over)
        w = ipuxl.remote_replica_sharded_variable(host, buffer, 0, name="w", replica_grouping=rg,
                                                  shard_over=shard_over)
        shard = ops.remote_load(buffer, 0)
        out = _store(shard, "shard")
        ops.remote_store(buffer, 0, shard * 2.0)
    assert buffer.tensor_shape == (-(-15 // over),) and buffer.meta_shape == full_shape
    assert w.shape == buffer.tensor_shape and w.meta_shape == full_shape
    assert w.shape_on_host == host.shape
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run()[out].reshape(replicas, -1)
    for g, members in enumerate(groups):
        for position, replica in enumerate(members):
            assert_close(got[replica], expected_shard(data[g], position % over, over))
    assert_close(session.get_tensor_data(w), host * 2.0)  # the host holds full tensors, gathered


def test_sharded_load_then_all_gather_restores_the_full_tensor():
    data = np.random.default_rng(0).standard_normal((2, 4, 3)).astype(np.float32)  # one value per group
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        group = ir.replica_grouping(stride=2, group_size=2)  # groups {0, 2} and {1, 3}, each sharded
        buffer = ipuxl.replica_sharded_buffer((2, 4, 3), F32, replica_grouping=group)  # 2 groups: leading dim
        ipuxl.remote_replica_sharded_variable(data, buffer, 0, replica_grouping=group)
        full = ops.collectives.replicated_all_gather(ops.remote_load(buffer, 0), group=shard_grouping(group, 2))
        out = _store(full, "full")
    assert full.shape == (4, 3)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run()[out]
    assert_close(got, data[[0, 1, 0, 1]])


def test_on_chip_replica_sharded_variable_updates_its_shards_in_place():
    data = np.arange(10, dtype=np.float32).reshape(2, 5)
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        var, shard = ipuxl.replica_sharded_variable(data, name="v")
        ops.var_updates.accumulate_(shard, ipuxl.constant(np.ones(3, np.float32)))
        out = _store(shard, "shard")
    assert shard.shape == (3,) and shard.meta_shape == (2, 5) and var.shape_on_host == (2, 5)
    session = ipuxl.Session(ir, "cpu")
    with session:
        got = session.run()[out]
    for r in range(4):
        assert_close(got[r], expected_shard(data, r, 4) + 1.0)
    # the padding of the last shard was updated too, but the host holds only the 10 real elements
    assert_close(session.get_tensor_data(var), data + 1.0)
    session.write_variable_data(var, np.zeros((2, 5), np.float32))
    with session:
        got = session.run()[out]
    assert_close(got, np.ones((4, 3), np.float32))


def test_gradient_through_a_sharded_gather_is_each_replicas_shard_of_its_own_gradient():
    """loss_r = sum((x_r @ W) ** 2) on replica r, W gathered from its shards: each replica's
    shard gradient is its shard of its own dloss_r/dW, not of the sum over replicas (PopXL:
    all-gather's gradient is a replicated slice, PopART's Local reduce-scatter; upstream's
    test_output_shape_meta_shape checks the same)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    xs = rng.standard_normal((4, 5, 3)).astype(np.float32)
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        var, shard = ipuxl.replica_sharded_variable(w, name="w")

        def forward(s, x):
            full = ops.collectives.replicated_all_gather(s)
            y = x @ full
            return ops.sum(y * y)

        x_stream = ipuxl.h2d_stream((5, 3), F32, "x")
        x = ops.host_load(x_stream)
        # PopXL graphs take a shard with its meta shape (popxl.addons: replica_sharded_spec)
        graph = ir.create_graph(forward, ipuxl.TensorSpec(shard.shape, F32, shard.meta_shape), x)
        info = transforms.autodiff(graph, grads_required=[graph.inputs[0]])
        fwd = ops.call_with_info(graph, shard, x)
        (grad,) = ops.call(info.graph, ipuxl.constant(np.ones((), np.float32)), inputs_dict=info.inputs_dict(fwd))
        out = _store(grad, "grad")
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run({x_stream: xs})[out]
    wt = torch.tensor(w, requires_grad=True)
    for r in range(4):
        (dw,) = torch.autograd.grad(((torch.tensor(xs[r]) @ wt) ** 2).sum(), wt)
        assert_close(got[r], expected_shard(dw.numpy(), r, 4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [None, (2, 2)], ids=["all", "stride2"])
def test_replica_sharded_slice_and_its_gradient(group):
    data = np.arange(7, dtype=np.float32)
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        rg = ir.replica_grouping(*group) if group else None
        size = rg.group_size if rg else 4
        x = ipuxl.variable(data, F32, name="x")
        metas = []

        def sliced_times_3(t):
            part = ops.collectives.replica_sharded_slice(t, group=rg)
            metas.append(part.meta_shape)
            return part * 3.0

        graph = ir.create_graph(sliced_times_3, x)
        info = transforms.autodiff(graph)
        fwd = ops.call_with_info(graph, x)
        (sliced,) = fwd.outputs
        dy_stream = ipuxl.h2d_stream(sliced.shape, F32, "dy")
        (dx,) = ops.call(info.graph, ops.host_load(dy_stream), inputs_dict=info.inputs_dict(fwd))
        s_out, g_out = _store(sliced, "sliced"), _store(dx, "dx")
    assert sliced.shape == (-(-7 // size),) and metas == [(7,)]
    dys = np.arange(4 * sliced.shape[0], dtype=np.float32).reshape(4, -1)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run({dy_stream: dys})
    groups = groups_of(4, *(group or (1, 4)))
    for members in groups:
        for position, replica in enumerate(members):
            assert_close(got[s_out][replica], 3.0 * expected_shard(data, position, size))
            gathered = np.concatenate([dys[m] for m in members])[:7]  # the group's dy shards, all-gathered
            assert_close(got[g_out][replica], 3.0 * gathered)


def test_replicated_slice_along_an_axis():
    data = np.arange(24, dtype=np.float32).reshape(2, 12)
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        x = ipuxl.variable(data, F32, name="x")
        out = _store(ops.collectives.replicated_slice(x, axis=1), "out")
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run()[out]
    for r in range(4):
        assert_close(got[r], data[:, 3 * r:3 * r + 3])


def test_sharding_errors():
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        with pytest.raises(InvalidValueError, match="shard_over=3 must be a positive int dividing"):
            ipuxl.replica_sharded_buffer((6,), F32, shard_over=3)
        group = ir.replica_grouping(1, 2)
        with pytest.raises(UnsupportedError, match="all_replicas"):
            ipuxl.replica_sharded_variable(np.zeros((2, 4), np.float32), replica_grouping=group,
                                           retrieval_mode="all_replicas")
        buffer = ipuxl.replica_sharded_buffer((4, 4), F32)
        with pytest.raises(Exception, match=r"sharded over 4 replicas: \(3,\)"):
            ipuxl.remote_replica_sharded_variable(np.zeros((3, 4), np.float32), buffer, 0)
        with pytest.raises(Exception, match="not a multiple of the group size"):
            ops.collectives.replicated_slice(ipuxl.constant(np.zeros((2, 3), np.float32)), axis=1)


def test_a_buffer_given_a_meta_shape_by_hand_takes_sharded_variables():
    """popxl.addons makes RTS buffers as ``remote_buffer(shard_shape)`` + ``buffer.meta_shape = ...``."""
    data = np.arange(8, dtype=np.float32).reshape(2, 4)
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((4,), F32)
        buffer.meta_shape = (2, 4)
        w = ipuxl.remote_replica_sharded_variable(data, buffer, 0)
        out = _store(ops.remote_load(buffer, 0), "shard")
    assert w.shard_over == 2 and w.meta_shape == (2, 4)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run()[out]
    assert_close(got, data)  # replica r holds row r: shard r of the flattened tensor
    assert_close(session.get_tensor_data(w), data)
