"""Collectives, replica groupings, replicated streams and variables against numpy references."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.kernels import collectives as kernels
from ipuxl.errors import DeviceError, InvalidArgumentError, ReplicationError, ShapeMismatchError, StreamInputError
from ipuxl.ir.meta import OP

from ._harness import check_op, randn

F32 = ipuxl.float32

NUMPY_REDUCE = {
    "add": lambda s: s.sum(0),
    "mean": lambda s: s.sum(0) / s.shape[0],
    "mul": lambda s: s.prod(0),
    "min": lambda s: s.min(0),
    "max": lambda s: s.max(0),
    "square_add": lambda s: (s * s).sum(0),
}

# (replicas, stride, group_size); None = the default grouping (all replicas)
GROUPINGS = [(2, None, None), (4, None, None), (4, 1, 2), (4, 2, 2), (8, 2, 4), (8, 4, 2), (4, 1, 1)]


def groups_of(replicas: int, stride: int, size: int) -> list[list[int]]:
    """PopXL's documented partition, written independently: members ``stride`` apart."""
    groups, seen = [], set()
    for start in range(replicas):
        if start in seen:
            continue
        members = [start + k * stride for k in range(size)]
        seen.update(members)
        groups.append(members)
    return groups


def _run(replicas: int, build, data: np.ndarray, steps: int = 1):
    """Build ``out = build(ir, x)`` for replicated input data (steps?, R, ...); return host outputs."""
    ir = ipuxl.Ir(replication=replicas)
    ir.num_host_transfers = steps
    shape = data.shape[(steps > 1) + (replicas > 1):]  # PopXL drops leading dims of size 1
    with ir.main_graph:
        x_s = ipuxl.h2d_stream(shape, F32, "x")
        out = build(ir, ops.host_load(x_s))
        out_s = ipuxl.d2h_stream(out.shape, out.dtype, "out")
        ops.host_store(out_s, out)
    with ipuxl.Session(ir, "cpu") as session:
        return session.run({x_s: data})[out_s]


def _group(ir, stride, size):
    return None if stride is None else ir.replica_grouping(stride, size)


def _members(replicas, stride, size):
    return groups_of(replicas, 1, replicas) if stride is None else groups_of(replicas, stride, size)


@pytest.mark.parametrize("replicas, stride, size", GROUPINGS)
@pytest.mark.parametrize("op", sorted(NUMPY_REDUCE))
def test_all_reduce_equals_numpy_per_group(replicas, stride, size, op):
    data = np.random.default_rng(replicas).uniform(0.5, 1.5, (replicas, 2, 3)).astype(np.float32)
    got = _run(replicas, lambda ir, x: ops.collectives.replicated_all_reduce(x, op, _group(ir, stride, size)), data)
    assert got.shape == data.shape
    for members in _members(replicas, stride, size):
        expected = NUMPY_REDUCE[op](data[members].astype(np.float64))
        for r in members:
            np.testing.assert_allclose(got[r], expected, rtol=1e-6)


@pytest.mark.parametrize("op", ["and", "or"])
def test_logical_all_reduce(op):
    data = np.array([[1, 0, 1, 0], [1, 1, 0, 0]], np.float32)
    got = _run(2, lambda ir, x: ops.collectives.replicated_all_reduce(x, op), data)
    expected = np.logical_and(*data) if op == "and" else np.logical_or(*data)
    np.testing.assert_array_equal(got, np.stack([expected, expected]).astype(np.float32))


@pytest.mark.parametrize("replicas, stride, size", GROUPINGS)
def test_in_place_all_reduce_of_a_variable_over_device_iterations(replicas, stride, size):
    """w <- all_reduce(w + x) each step: checks in-place writes and per-replica variables."""
    rng = np.random.default_rng(7)
    steps = 3
    data = rng.standard_normal((steps, replicas, 4)).astype(np.float32)
    ir = ipuxl.Ir(replication=replicas)
    ir.num_host_transfers = steps
    with ir.main_graph:
        x_s = ipuxl.h2d_stream((4,), F32, "x")
        w = ipuxl.variable(np.zeros(4, np.float32), F32, name="w", retrieval_mode="all_replicas")

        def step(w: ipuxl.TensorByRef):  # the device loop's body: loads its x
            ops.scaled_add_(w, ops.host_load(x_s))
            ops.collectives.replicated_all_reduce_(w, "mean", _group(ir, stride, size))

        ops.repeat(ir.create_graph(step, w), steps, w)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({x_s: data})
        got = session.get_tensor_data(w)
    expected = np.zeros((replicas, 4))
    for step in range(steps):
        expected = expected + data[step]
        for members in _members(replicas, stride, size):
            expected[members] = expected[members].mean(0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas, stride, size", GROUPINGS)
@pytest.mark.parametrize("numel", [6, 7])
def test_reduce_scatter_gives_each_member_its_padded_slice(replicas, stride, size, numel):
    data = np.random.default_rng(numel).standard_normal((replicas, numel)).astype(np.float32)
    got = _run(replicas, lambda ir, x: ops.collectives.replicated_reduce_scatter(x, "add", _group(ir, stride, size)),
               data)
    for members in _members(replicas, stride, size):
        total = data[members].astype(np.float64).sum(0)
        shard = -(-numel // len(members))
        padded = np.concatenate([total, np.zeros(shard * len(members) - numel)])
        for i, r in enumerate(members):
            np.testing.assert_allclose(got[r], padded[i * shard:(i + 1) * shard], rtol=1e-6)


@pytest.mark.parametrize("replicas, stride, size", GROUPINGS)
@pytest.mark.parametrize("mode, axis", [("new_axis", 0), ("concat", 0), ("concat", 1), ("auto", -1)])
def test_all_gather_equals_numpy(replicas, stride, size, mode, axis):
    data = np.random.default_rng(3).standard_normal((replicas, 2, 3)).astype(np.float32)
    got = _run(replicas, lambda ir, x: ops.collectives.replicated_all_gather(
        x, axis=axis, group=_group(ir, stride, size), output_shape=mode), data)
    for members in _members(replicas, stride, size):
        parts = [data[m] for m in members]
        expected = np.stack(parts) if mode == "new_axis" else np.concatenate(parts, axis=axis)
        for r in members:
            np.testing.assert_array_equal(got[r], expected)


def test_sharded_reduce_scatter_then_all_gather_restores_the_reduced_tensor():
    """Replicated tensor sharding: the meta shape brings back the unpadded, unflattened sum."""
    replicas = 4
    data = np.random.default_rng(4).standard_normal((replicas, 3, 3)).astype(np.float32)

    def build(ir, x):
        shard = ops.collectives.replicated_reduce_scatter(
            x, "add", configure_output_for_replicated_tensor_sharding=True)
        assert shard.shape == (3,)
        return ops.collectives.replicated_all_gather(shard)

    got = _run(replicas, build, data)
    for r in range(replicas):
        np.testing.assert_allclose(got[r], data.astype(np.float64).sum(0), rtol=1e-6)


def test_one_replica_collectives_act_on_that_replica():
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(_run(1, lambda ir, x: ops.collectives.replicated_all_reduce(x), data), data)
    gathered = _run(1, lambda ir, x: ops.collectives.replicated_all_gather(x, output_shape="new_axis"), data)
    np.testing.assert_array_equal(gathered, data[None])
    scattered = _run(1, lambda ir, x: ops.collectives.replicated_reduce_scatter(x), data)
    np.testing.assert_array_equal(scattered, data.reshape(-1))


def test_collective_inside_a_called_subgraph():
    replicas = 2
    data = np.array([[1, 2], [3, 4]], np.float32)

    def build(ir, x):
        graph = ir.create_graph(lambda t: ops.collectives.replicated_all_reduce(t * 2.0, "add"), x)
        (y,) = ops.call(graph, x)
        return y

    got = _run(replicas, build, data)
    np.testing.assert_array_equal(got, np.array([[8, 12], [8, 12]], np.float32))


# -- groupings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("replicas, stride, size", [(8, 1, 2), (8, 1, 4), (8, 2, 4), (8, 4, 2), (6, 3, 2), (4, 1, 4)])
def test_grouping_assignment_matches_popxl_docs(replicas, stride, size):
    grouping = ipuxl.ReplicaGrouping(replicas, stride, size)
    expected = groups_of(replicas, stride, size)
    assert grouping.groups == expected
    assert grouping.num_groups == len(expected)
    for g, members in enumerate(grouping.groups):
        assert all(grouping.assignment[m] == g for m in members)


def test_documented_assignments_and_transpose():
    ir = ipuxl.Ir(replication=8)
    assert ir.replica_grouping(1, 2).assignment == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ir.replica_grouping(2, 4).assignment == [0, 1, 0, 1, 0, 1, 0, 1]
    assert ir.replica_grouping(4, 2).assignment == [0, 1, 2, 3, 0, 1, 2, 3]
    assert ir.replica_grouping().group_size == 8
    for grouping in (ir.replica_grouping(1, 2), ir.replica_grouping(2, 4), ir.replica_grouping(4, 2)):
        transposed = grouping.transpose()  # each of its groups meets each group once
        assert all(len(set(a) & set(b)) == 1 for a in grouping.groups for b in transposed.groups)
    assert ir.replica_grouping(1, 2).transpose() == ir.replica_grouping(2, 4)
    with ir.main_graph:
        assert ipuxl.replica_grouping(2) == ir.replica_grouping(2, 4)


def test_grouped_variables_hold_one_value_per_group():
    replicas = 4
    ir = ipuxl.Ir(replication=replicas)
    grouping = ir.replica_grouping(stride=2, group_size=2)  # groups {0, 2}, {1, 3}
    init = np.array([[1.0, 1.0], [5.0, 5.0]], np.float32)
    with ir.main_graph:
        x_s = ipuxl.h2d_stream((2,), F32, "x")
        w = ipuxl.variable(init, F32, name="w", replica_grouping=grouping)
        assert w.shape == (2,)
        ops.scaled_add_(w, ops.host_load(x_s))
        ops.collectives.replicated_all_reduce_(w, "mean", grouping)
    data = np.arange(8, dtype=np.float32).reshape(4, 2)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({x_s: data})
        got = session.get_tensor_data(w)
        assert got.shape == (2, 2)
        np.testing.assert_allclose(got[0], init[0] + (data[0] + data[2]) / 2)
        np.testing.assert_allclose(got[1], init[1] + (data[1] + data[3]) / 2)
        session.write_variable_data(w, np.zeros((2, 2), np.float32))
        session.run({x_s: data})
        np.testing.assert_allclose(session.get_tensor_data(w)[1], (data[1] + data[3]) / 2)
        with pytest.raises(ShapeMismatchError, match=r"one per replica group"):
            session.write_variable_data(w, np.zeros(2, np.float32))


# -- errors ---------------------------------------------------------------------------------------------------
def test_input_with_the_wrong_replica_dimension():
    ir = ipuxl.Ir(replication=2)
    ir.num_host_transfers = 3
    with ir.main_graph:
        x_s = ipuxl.h2d_stream((4,), F32, "x")
        y_s = ipuxl.d2h_stream((4,), F32, "y")
        for _ in range(3):  # unrolled: three loads and stores per run
            ops.host_store(y_s, ops.host_load(x_s) * 2.0)
    with ipuxl.Session(ir, "cpu") as session:
        with pytest.raises(ReplicationError, match=r"(?s)'x' has replica dimension 4 \(axis 1\).*2 replicas.*\(3, 2, 4\)"):
            session.run({x_s: np.zeros((3, 4, 4), np.float32)})
        with pytest.raises(StreamInputError, match=r"expects shape \(3, 2, 4\)"):
            session.run({x_s: np.zeros((3, 4), np.float32)})


def test_group_that_does_not_divide_the_replicas():
    ir = ipuxl.Ir(replication=4)
    with pytest.raises(ReplicationError, match=r"(?s)stride=1, group_size=3.*4 replicas"):
        ir.replica_grouping(1, 3)
    with pytest.raises(ReplicationError, match=r"stride=4, group_size=2"):
        ir.replica_grouping(4, 2)
    other = ipuxl.Ir(replication=2).replica_grouping()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros(2, np.float32), F32, name="x")
        with pytest.raises(ReplicationError, match=r"(?s)replicated_all_reduce of 'x'.*2 replicas.*replication factor 4"):
            ops.collectives.replicated_all_reduce(x, group=other)
        with pytest.raises(InvalidArgumentError, match="unknown reduction op 'sum'"):
            ops.collectives.replicated_all_reduce(x, "sum")


def test_grouped_variable_data_without_the_group_dimension():
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        with pytest.raises(ReplicationError, match=r"(?s)'w'.*2 groups.*\(2, \*variable_shape\)"):
            ipuxl.variable(np.zeros(3, np.float32), F32, name="w", replica_grouping=ir.replica_grouping(1, 2))


def test_a_failing_replica_stops_the_others_with_its_error():
    """Replica 1 indexes out of range; replica 0 waits in the collective and must not hang."""
    replicas = 2
    ir = ipuxl.Ir(replication=replicas)
    with ir.main_graph:
        table = ipuxl.variable(np.arange(4, dtype=np.float32), F32, name="table")
        i_s = ipuxl.h2d_stream((1,), ipuxl.int32, "i")
        picked = ops.gather(table, ops.host_load(i_s))
        out = ops.collectives.replicated_all_reduce(picked)
        ops.host_store(ipuxl.d2h_stream(out.shape, out.dtype, "out"), out)
    with ipuxl.Session(ir, "cpu") as session:
        with pytest.raises(DeviceError, match=r"failed in step 1 of 1, replica 1 of 2"):
            session.run({i_s: np.array([[1], [9]], np.int32)})
        result = session.run({i_s: np.array([[1], [2]], np.int32)})  # the session still works
    assert list(result.values())[0].tolist() == [[3.0], [3.0]]
    # no replica thread is left (other libraries' threads, e.g. tqdm's monitor, may start meanwhile)
    assert not [t for t in threading.enumerate() if t.name.startswith("ipuxl-replica")]


def test_autodiff_through_a_collective_is_refused_with_the_pattern_to_use():
    from ipuxl import transforms
    from ipuxl.errors import AutodiffError

    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        x = ipuxl.variable(np.ones(3, np.float32), F32, name="x")
        inner = ir.create_graph(lambda t: ops.collectives.replicated_all_reduce(t), x)
        outer = ir.create_graph(lambda t: ops.call(inner, t * 2.0)[0], x)
        with pytest.raises(AutodiffError, match=r"(?s)contains replicated_all_reduce.*all-reduce its gradients"):
            transforms.autodiff(outer)


class _Scaled:
    """An exchange of 4 replicas where replica ``r`` contributes ``tensor * (r + 1)``."""

    replication_factor = 4

    def exchange(self, replica, tensor, combine):
        return combine([tensor * (r + 1) for r in range(4)], [replica])[0]


def test_collective_kernels_meet_through_the_exchange_the_device_installs():
    """The kernels know no device: outside any replica a collective acts on the one tensor;
    under ``running_as`` it combines what the installed exchange gathers."""
    x = torch.tensor([1.0, 2.0])
    assert_close(kernels.all_reduce(x, "add", 1, 1), x)
    with kernels.running_as(_Scaled(), 2):
        assert kernels.current_replica()[1] == 2
        assert_close(kernels.all_reduce(x, "add", 1, 4), x * 10)
        assert_close(kernels.all_gather(x, 0, "new_axis", 2, 2), torch.stack([x, x * 3]))  # group [0, 2]
    assert kernels.current_replica() == (None, 0)


@pytest.mark.parametrize("flag", [True, False], ids=["then", "else"])
def test_a_collective_inside_a_conditional_branch(flag):
    """ops.conditional runs both branches on every replica, so a collective in a branch
    is matched on all replicas; the output is the taken branch's (sum over replicas or
    the replica's own data doubled)."""
    data = np.random.default_rng(5).uniform(0.5, 1.5, (4, 2, 3)).astype(np.float32)

    def build(ir, x):
        spec = ipuxl.TensorSpec((2, 3), F32)
        summed = ir.create_graph(lambda t: ops.collectives.replicated_all_reduce(t, "add"), spec)
        doubled = ir.create_graph(lambda t: t * 2.0, spec)
        cond = ipuxl.constant(np.array(flag), name="cond")
        return ops.conditional(cond, summed, doubled, [x], [x])[0]

    got = _run(4, build, data)
    expected = np.broadcast_to(data.sum(0), data.shape) if flag else data * 2.0
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("mode, axis", [("concat", 0), ("concat", 1), ("new_axis", 0)])
def test_all_gather_gradient_is_each_replicas_slice_of_its_own_gradient(mode, axis):
    """PopXL's rule: the gradient of replicated_all_gather is a replicated slice (PopART's Local
    reduce-scatter), not a sum over the replicas; the replicas' output gradients differ here."""
    replicas = 2
    x = randn((replicas, 2, 3))  # per replica
    dy_shape = (replicas, 2, 3)[1:]
    dy_shape = (replicas,) + dy_shape if mode == "new_axis" else tuple(
        d * replicas if i == axis else d for i, d in enumerate(dy_shape))
    dy = randn((replicas, *dy_shape), seed=1)
    scale = randn(dy_shape, seed=2)

    ir = ipuxl.Ir(replication=replicas)
    with ir.main_graph:
        xs, dys = ipuxl.h2d_stream((2, 3), ipuxl.float64, "x"), ipuxl.h2d_stream(dy_shape, ipuxl.float64, "dy")

        def body(t):
            return ops.collectives.replicated_all_gather(t, axis, output_shape=mode) * ipuxl.constant(scale, name="c")

        graph = ir.create_graph(body, ipuxl.TensorSpec((2, 3), ipuxl.float64))
        fwd = ops.call_with_info(graph, ops.host_load(xs))
        info = ipuxl.transforms.autodiff(graph)
        (dx,) = ops.call(info.graph, ops.host_load(dys), inputs_dict=info.inputs_dict(fwd))
        outs = {}
        for name, t in (("y", fwd.outputs[0]), ("dx", dx)):
            outs[name] = ipuxl.d2h_stream(t.shape, t.dtype, name)
            ops.host_store(outs[name], t)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run({xs: x, dys: dy})

    xt, dyt, ct = (torch.from_numpy(a) for a in (x, dy, scale))
    gathered = torch.stack(list(xt)) if mode == "new_axis" else torch.cat(list(xt), axis)
    torch.testing.assert_close(torch.from_numpy(got[outs["y"]]), torch.stack([gathered * ct] * replicas))
    d_gathered = dyt * ct  # each replica's gradient of its own gathered tensor
    expected_dx = torch.stack([d_gathered[r].select(0, r) if mode == "new_axis"
                               else d_gathered[r].narrow(axis, 2 * r if axis == 0 else 3 * r, 2 if axis == 0 else 3)
                               for r in range(replicas)])
    torch.testing.assert_close(torch.from_numpy(got[outs["dx"]]), expected_dx)


def test_all_gather_gradient_of_the_same_output_gradient_is_the_input_as_in_popxl():
    """Upstream's own check: gather x over 4 replicas, feed the gathered tensor back as every
    replica's gradient: each replica's dx is its own x (a sum would give 4 x)."""
    replicas = 4
    x = randn((replicas, 4, 3))
    ir = ipuxl.Ir(replication=replicas)
    group = ir.replica_grouping(group_size=replicas)
    with ir.main_graph:
        xv = ipuxl.variable(x, ipuxl.float64, name="x", replica_grouping=group.transpose())
        graph = ir.create_graph(lambda t: ops.collectives.replicated_all_gather(t, output_shape="new_axis",
                                                                                group=group), xv)
        info = ipuxl.transforms.autodiff(graph)
        (y,) = ops.call(graph, xv)
        (dx,) = ops.call(info.graph, y)
        out = ipuxl.d2h_stream(dx.shape, dx.dtype, "dx")
        ops.host_store(out, dx)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run()[out]
    np.testing.assert_array_equal(got, x)


def test_autodiff_still_refuses_other_collectives():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        x = ipuxl.variable(np.ones(3, np.float32), name="x")
        graph = ir.create_graph(lambda t: ops.collectives.replicated_all_reduce(t), x)
        with pytest.raises(ValueError, match="contains replicated_all_reduce"):
            ipuxl.transforms.autodiff(graph)


def test_autodiff_keeps_the_all_gather_a_collective():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        graph = ir.create_graph(lambda t: ops.collectives.replicated_all_gather(t) * 2.0,
                                ipuxl.TensorSpec((3,), ipuxl.float32))
        ipuxl.transforms.autodiff(graph)
    ops_in_forward = [n.meta.get(OP) for n in graph.fx.nodes]
    assert "replicated_all_gather" in ops_in_forward


# -- all_reduce across the IPUs of one replica ------------------------------------------------------------
def _sum_of(xs):
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def _identity_forward_sum_backward(*xs):
    """torch: outputs equal their inputs; each input's gradient is the sum of the output gradients."""
    s = _sum_of(xs)
    return [x.detach() + (s - s.detach()) for x in xs]


def _sum_forward_identity_backward(*xs):
    """torch: every output is the sum; each input's gradient is its own output's gradient."""
    s = _sum_of(xs).detach()
    return [s + (x - x.detach()) for x in xs]


@pytest.mark.parametrize("fn, reference", [
    (ops.collectives.all_reduce, lambda *xs: [_sum_of(xs) for _ in xs]),
    (ops.collectives.all_reduce_identical_inputs, _identity_forward_sum_backward),
    (ops.collectives.all_reduce_identical_grad_inputs, _sum_forward_identity_backward),
], ids=["all_reduce", "identical_inputs", "identical_grad_inputs"])
def test_all_reduce_across_ipus_values_and_gradients(fn, reference):
    check_op(lambda *ts: fn(list(ts), ipus=[0, 1, 2]), reference, [(2, 3), (2, 3), (2, 3)])


@pytest.mark.parametrize("op", ["add", "mean", "mul", "min", "max", "square_add"])
def test_all_reduce_across_ipus_places_one_result_on_each_ipu(op):
    data = [randn((4,), np.float32, seed=i) for i in range(2)]
    ir = ipuxl.Ir()
    with ir.main_graph:
        parts = []
        for i, d in enumerate(data):
            with ipuxl.ipu(i):
                parts.append(ipuxl.variable(d, name=f"x{i}") * 1.0)
        outs = ops.collectives.all_reduce(parts, op=op)
        assert [t.ipu for t in outs] == [0, 1]
        streams = []
        for i, t in enumerate(outs):
            with ipuxl.ipu(i):  # a store on another IPU would need an ipu_copy
                streams.append(ipuxl.d2h_stream(t.shape, t.dtype, f"y{i}"))
                ops.host_store(streams[-1], t)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run()
    for s in streams:
        np.testing.assert_allclose(got[s], NUMPY_REDUCE[op](np.stack(data)), rtol=1e-6)


def test_all_reduce_across_ipus_errors():
    ir = ipuxl.Ir()
    with ir.main_graph:
        with ipuxl.ipu(0):
            a = ipuxl.variable(np.zeros(3, np.float32), name="a") + 1.0
        with ipuxl.ipu(1):
            b = ipuxl.variable(np.zeros(3, np.float32), name="b") + 1.0
            c = ipuxl.variable(np.zeros(4, np.float32), name="c") + 1.0
        unplaced = ipuxl.variable(np.zeros(3, np.float32), name="unplaced")
        with pytest.raises(ValueError, match="Could not automatically infer the IPU"):
            ops.collectives.all_reduce([a, unplaced])
        with pytest.raises(ValueError, match="Number of specified tensor does not equal number of specified IPUs. 2 != 3"):
            ops.collectives.all_reduce([a, b], ipus=[0, 1, 2])
        with pytest.raises(ValueError, match="Not a valid op: sum"):
            ops.collectives.all_reduce([a, b], op="sum")
        with pytest.raises(ShapeMismatchError, match="differ in shape or dtype"):
            ops.collectives.all_reduce([a, c])
        assert len(ops.collectives.all_reduce([a, unplaced], ipus=[0, 1])) == 2


def test_all_reduce_across_ipus_has_a_gradient_only_for_add():
    spec = ipuxl.TensorSpec((3,), F32)
    ir = ipuxl.Ir()
    graph = ir.create_graph(lambda x, y: tuple(ops.collectives.all_reduce([x, y], ipus=[0, 1], op="max")), spec, spec)
    with pytest.raises(ValueError, match="only 'add' is supported by autodiff"):
        ipuxl.transforms.autodiff(graph)


@pytest.mark.parametrize("axis, expected", [
    (0, lambda x, r: x[r]),           # (4, 2, 3) -> (2, 3): the sliced axis is dropped
    (1, lambda x, r: x[:, r, :].T),   # (2, 4, 3) -> (3, 2): PopXL moves the first remaining axis to `axis`
    (2, lambda x, r: x[:, :, r].T),   # (2, 3, 4) -> (3, 2): (its `_rearrange_output` on the shorter shape)
])
def test_replicated_slice_of_one_row_per_member_drops_the_axis_as_popxl(axis, expected):
    replicas = 4
    shape = [2, 3]
    shape.insert(axis, replicas)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    got = _run(replicas, lambda ir, t: ops.collectives.replicated_slice(t, axis=axis),
               np.broadcast_to(x, (replicas, *shape)).copy())
    for r in range(replicas):
        np.testing.assert_array_equal(got[r], expected(x, r))


def test_replicated_slice_of_one_row_per_member_has_the_all_gather_gradient():
    """Upstream's check: slice (4, 4, 3) over 4 replicas to (4, 3) each, feed the slice back as the
    gradient: the gradient all-gathers every member's slice into the whole tensor."""
    replicas = 4
    x = randn((replicas, 4, 3))
    ir = ipuxl.Ir(replication=replicas)
    with ir.main_graph:
        xv = ipuxl.variable(x, ipuxl.float64, name="x")
        graph = ir.create_graph(lambda t: ops.collectives.replicated_slice(t, group=ir.replica_grouping()), xv)
        info = ipuxl.transforms.autodiff(graph)
        (y,) = ops.call(graph, xv)
        (dx,) = ops.call(info.graph, y)
        assert y.shape == (4, 3) and dx.shape == (4, 4, 3)
        outs = {name: ipuxl.d2h_stream(t.shape, t.dtype, name) for name, t in (("y", y), ("dx", dx))}
        ops.host_store(outs["y"], y)
        ops.host_store(outs["dx"], dx)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run()
    np.testing.assert_array_equal(got[outs["y"]], x)
    np.testing.assert_array_equal(got[outs["dx"]][0], x)
