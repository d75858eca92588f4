"""popxl.addons' ``remote``, ``rts``, replica-sharded variable factories and batch
serialisation (#17) against numpy.

Programs run on 2 in-process replicas on the "cpu" device; each replica's data comes
from its own slice of a host stream, so per-replica values and their reductions are
checked exactly.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from torch.testing import assert_close

import ipuxl as popxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat.bound_args import SubsetBindGraph
from ipuxl.addons_compat.named_replica_grouping import NamedReplicaGrouping
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.remote import load_remote, named_variable_buffers, store_remote
from ipuxl.addons_compat.rts import (
    all_gather_replica_sharded_graph, reduce_replica_sharded_graph, replica_sharded_spec,
)
from ipuxl.addons_compat.transforms.batch_serialisation import (
    batch_serial_buffer, batch_serialise, batch_serialise_fwd_and_grad,
)
from ipuxl.errors import InvalidArgumentError, InvalidValueError

RNG = np.random.default_rng(17)
W = RNG.normal(size=(4, 6)).astype(np.float32)
B = RNG.normal(size=(6,)).astype(np.float32)


class Affine(addons.Module):
    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        w = self.add_variable_input("weight", lambda: W.copy(), popxl.float32)
        b = self.add_variable_input("bias", lambda: B.copy(), popxl.float32)
        return x @ w + b


def _run(ir: popxl.Ir, inputs: dict | None = None, fetch: list | None = None) -> tuple[dict, dict]:
    session = popxl.Session(ir, "cpu")
    with session:
        outputs = session.run(inputs or {})
    return outputs, session.get_tensors_data(fetch or [])


# -- factories ---------------------------------------------------------------------------
def test_replica_sharded_factory_has_the_shard_as_shape_and_the_whole_as_meta_shape():
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        class Sharded(addons.Module):
            def build(self, x):
                state = self.add_replica_sharded_variable_input("state", partial(np.zeros, (4, 6)), popxl.float32,
                                                                shard_over=2)
                return state

        facts, graph = Sharded().create_graph(popxl.TensorSpec((1,), popxl.float32))
    factory = facts.state
    assert (factory.shape, factory.meta_shape, factory.replica_sharded) == ((12,), (4, 6), True)
    assert graph.args.state.shape == (12,) and graph.args.state.meta_shape == (4, 6)
    assert factory.replica_grouping == ir.replica_grouping()  # upstream's default: all replicas
    with ir.main_graph, pytest.raises(InvalidArgumentError, match="cannot shard 6 elements"):
        addons.VariableFactory(partial(np.zeros, (6,)), popxl.float32, "odd", shard_over=4)


def test_replica_sharded_spec_shards_only_what_divides():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        t = popxl.variable(np.zeros((4, 6), np.float32))
        odd = popxl.variable(np.zeros((3,), np.float32))
        spec = replica_sharded_spec(t, shard_over=ir.replica_grouping())
        assert (spec.shape, spec.meta_shape) == ((12,), (4, 6))
        assert replica_sharded_spec(t, shard_over=1).shape == (4, 6)
        assert replica_sharded_spec(odd, shard_over=2).shape == (3,)
        shard = ops.collectives.replica_sharded_slice(t)
        assert replica_sharded_spec(shard, 2).shape == (12,)  # already sharded: unchanged
        with pytest.raises(InvalidArgumentError, match="shard_over must be"):
            replica_sharded_spec(t, shard_over="2")


# -- remote buffers ------------------------------------------------------------------------
def test_remote_variables_round_trip_through_load_and_store_graphs():
    """Weights live in Streaming Memory (weight sharded over both replicas); a step loads,
    gathers, uses and updates them, then stores them back: the host sees the update."""
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        x_stream = popxl.h2d_stream((3, 4), popxl.float32, "x")
        y_stream = popxl.d2h_stream((3, 6), popxl.float32, "y")
        facts, graph = Affine().create_graph(popxl.TensorSpec((3, 4), popxl.float32))
        buffers = named_variable_buffers(facts, entries=2, shard_over_dict={"weight": 2, "bias": 1})
        assert buffers.weight.meta_shape == (4, 6) and buffers.weight.tensor_shape == (12,)
        assert buffers.bias.tensor_shape == (6,) and not buffers.bias.meta_shape
        variables = facts.init_remote(buffers, entry=1, prefix="layer")
        load, names = addons.load_remote_graph(buffers, entries=2)
        store = addons.store_remote_graph(buffers, entries=2)
        gather, gather_names = all_gather_replica_sharded_graph(
            NamedTensors.pack(names, load.graph.outputs),
            replica_groups=NamedReplicaGrouping.from_dict({"weight": ir.replica_grouping(),
                                                           "bias": ir.replica_grouping()}))
        with popxl.in_sequence(True):
            loaded = NamedTensors.pack(names, load.call(1))
            assert loaded.weight.meta_shape == (4, 6)
            whole = NamedTensors.pack(gather_names, gather.bind(loaded).call())
            (y,) = graph.bind(whole).call(ops.host_load(x_stream))
            ops.host_store(y_stream, y)
            updated = NamedTensors.from_dict({"weight": loaded.weight * 2.0, "bias": loaded.bias + 1.0})
            store.bind(updated).call(1)
    x = RNG.normal(size=(2, 3, 4)).astype(np.float32)
    outputs, data = _run(ir, {x_stream: x}, [variables.weight, variables.bias])
    assert_close(outputs[y_stream], x @ W + B)
    assert_close(data[variables.weight], 2.0 * W)
    assert_close(data[variables.bias], B + 1.0)


def test_load_remote_and_store_remote_inline():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        facts, _ = Affine().create_graph(popxl.TensorSpec((3, 4), popxl.float32))
        buffers = named_variable_buffers(facts, shard_over_dict=False)
        variables = facts.init_remote(buffers)
        with popxl.in_sequence(True):
            loaded = load_remote(buffers, 0)
            store_remote(buffers, loaded.map(lambda t: t - 1.0), 0)
    _, data = _run(ir, fetch=[variables.weight, variables.bias])
    assert_close(data[variables.weight], W - 1.0)
    assert_close(data[variables.bias], B - 1.0)


def test_named_variable_buffers_errors():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        facts, _ = Affine().create_graph(popxl.TensorSpec((3, 4), popxl.float32))
        with pytest.raises(InvalidArgumentError, match="shard_over_dict must be"):
            named_variable_buffers(facts, shard_over_dict=[2])
        with pytest.raises(InvalidArgumentError, match=r"not in \[1, 2\]"):
            named_variable_buffers(facts, shard_over_dict=3)
        with pytest.raises(InvalidArgumentError, match="can't shard a tensor of 6 elements"):
            named_variable_buffers(facts, shard_over_dict={"weight": 1, "bias": 4})
        with pytest.raises(InvalidArgumentError, match=r"no remote buffer for the factories \['bias'\]"):
            only_weight = named_variable_buffers(facts, 1, False).weight
            facts.init_remote(addons.NamedRemoteBuffers.from_dict({"weight": only_weight}))


# -- replicated tensor sharding --------------------------------------------------------------
@pytest.mark.parametrize("shard", [True, False])
def test_reduce_then_gather_matches_the_numpy_mean(shard):
    """Reduce-scatter (shard group = replica group) or all-reduce (shard group of 1),
    then gather: every replica ends with the mean over replicas."""
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        g_stream = popxl.h2d_stream((4, 6), popxl.float32, "g")
        out_stream = popxl.d2h_stream((4, 6), popxl.float32, "out")
        shard_stream = popxl.d2h_stream((12,) if shard else (4, 6), popxl.float32, "shard")
        grads = NamedTensors.from_dict({"g": ops.host_load(g_stream)})
        group = ir.replica_grouping(group_size=2 if shard else 1)
        reduce, names = reduce_replica_sharded_graph(grads, "mean", shard_groups=NamedReplicaGrouping.from_dict(
            {"g": group}), replica_group=ir.replica_grouping())
        reduced = NamedTensors.pack(names, reduce.bind(grads).call())
        assert bool(reduced.g.meta_shape) is shard
        gather, gnames = all_gather_replica_sharded_graph(reduced, replica_groups=NamedReplicaGrouping.from_dict(
            {"g": group}))
        (whole,) = gather.bind(reduced).call()
        ops.host_store(shard_stream, reduced.g)
        ops.host_store(out_stream, whole)
    g = RNG.normal(size=(2, 4, 6)).astype(np.float32)
    outputs, _ = _run(ir, {g_stream: g})
    mean = g.mean(axis=0)
    assert_close(outputs[out_stream], np.stack([mean, mean]))
    expected_shards = mean.reshape(2, 12) if shard else np.stack([mean, mean])
    assert_close(outputs[shard_stream], expected_shards)


def test_reduce_graph_needs_a_group_per_tensor_and_binds_a_superset():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        a = popxl.variable(np.ones(4, np.float32), name="a")
        extra = popxl.variable(np.ones(2, np.float32), name="extra")
        with pytest.raises(InvalidArgumentError, match=r"shard_groups has no replica grouping for \['a'\]"):
            reduce_replica_sharded_graph(NamedTensors(a=a), shard_groups=NamedReplicaGrouping.from_dict(
                {"b": ir.replica_grouping()}))
        graph, _ = reduce_replica_sharded_graph(NamedTensors(a=a))
        assert isinstance(graph, SubsetBindGraph)
        graph.bind(NamedTensors(a=a, extra=extra))  # upstream binds the common keys
        with pytest.raises(InvalidArgumentError, match=r"missing keys \['a'\]"):
            graph.bind(NamedTensors(extra=extra))


# -- batch serialisation -----------------------------------------------------------------------
def test_batch_serialise_loads_computes_and_stores_each_step():
    """Rows of a buffer: the graph called for row 1 reads row 1's entries."""
    steps = 3
    ir = popxl.Ir(replication=1)
    with ir.main_graph:
        x_stream = popxl.h2d_stream((2, 4), popxl.float32, "x")
        y_stream = popxl.d2h_stream((2, 6), popxl.float32, "y")
        facts, graph = Affine().create_graph(popxl.TensorSpec((2, 4), popxl.float32))
        y_buffer = batch_serial_buffer(graph.graph.outputs[0], steps=steps, rows=2)
        to_buffer = batch_serialise(graph, steps, load_handles={graph.graph.inputs[0]: x_stream}, store_streams={},
                                    store_buffers={graph.graph.outputs[0]: (y_buffer, 1)}, rows=1)
        assert list(to_buffer.graph.args.keys_flat()) == ["weight", "bias"]
        variables = facts.init()
        with popxl.in_sequence(True):
            to_buffer.graph.bind(variables).call(0)
            # the buffer's second row holds the outputs; read them back through a d2h stream
            loop = ir.create_empty_graph("read_rows")
            with loop, popxl.in_sequence(True):
                i = popxl.graph_input([], popxl.int32, "i")
                ops.host_store(y_stream, ops.remote_load(y_buffer, i + steps))
                popxl.graph_output(i + 1)
            ops.repeat(loop, steps, popxl.constant(0, popxl.int32))
    ir.num_host_transfers = steps
    x = RNG.normal(size=(steps, 2, 4)).astype(np.float32)
    outputs, _ = _run(ir, {x_stream: x})
    assert y_buffer.entries == 2 * steps
    assert_close(outputs[y_stream], x @ W + B)


def test_batch_serialise_fwd_and_grad_accumulates_the_mean_gradient():
    """A linear layer batch-serialised over 4 micro-batches: the gradient loop loads
    the activations the forward loop stored and accumulates the mean weight gradient."""
    steps = 4
    ir = popxl.Ir(replication=1)
    with ir.main_graph:
        x_stream = popxl.h2d_stream((2, 4), popxl.float32, "x")
        dy_stream = popxl.h2d_stream((2, 6), popxl.float32, "dy")
        facts, fwd = Affine().create_graph(popxl.TensorSpec((2, 4), popxl.float32))
        grad_facts, bwd = addons.autodiff_with_accumulation(fwd, fwd.args.tensors, grads_required=[])
        y_buffer = batch_serial_buffer(fwd.graph.outputs[0], steps)
        fwd_bs, bwd_bs = batch_serialise_fwd_and_grad(
            fwd, bwd, fwd.args, steps, load_handles={fwd.graph.inputs[0]: x_stream, bwd.graph.inputs[0]: dy_stream},
            store_streams={}, store_buffers={fwd.graph.outputs[0]: (y_buffer, 0)}, io_mode="io")
        variables = facts.init()
        accums = grad_facts.init()
        with popxl.in_sequence(True):
            fwd_bs.graph.bind(variables).call(0)
            bound = NamedTensors.from_dict({**variables.to_dict(), **accums.to_dict()})
            bwd_bs.graph.bind(bound).call(0)
        with pytest.raises(InvalidValueError, match="Unknown 'io_mode'"):
            batch_serialise(fwd, steps, {}, {}, {}, io_mode="fast")
        with pytest.raises(InvalidArgumentError, match="has no load handle"):
            batch_serialise_fwd_and_grad(fwd, bwd, fwd.args, steps, {fwd.graph.inputs[0]: x_stream}, {}, {})
    ir.num_host_transfers = steps
    x = RNG.normal(size=(steps, 2, 4)).astype(np.float32)
    dy = RNG.normal(size=(steps, 2, 6)).astype(np.float32)
    _, data = _run(ir, {x_stream: x, dy_stream: dy}, [accums.accum.weight, accums.accum.bias])
    assert_close(data[accums.accum.weight], np.mean([x[i].T @ dy[i] for i in range(steps)], axis=0))
    assert_close(data[accums.accum.bias], dy.sum(axis=1).mean(axis=0))
