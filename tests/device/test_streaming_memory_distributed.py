"""Replicated tensor sharding across torchrun processes: the same bits as in one process.

The processes run this file as a script (``python -m torch.distributed.run ... this_file OUT``).
The program trains a weight that lives sharded in Streaming Memory: each step loads the
replica's shard, gathers the full weight, differentiates ``sum((x @ W) ** 2)`` through the
gather (a reduce-scatter of the gradient back to the shard), updates the shard and stores it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tests.device._torchrun import run_over_processes

HERE = Path(__file__).resolve()
REPLICAS, STEPS, LR = 2, 3, 0.01


def build(replication):
    import ipuxl
    import ipuxl.ops as ops
    from ipuxl import transforms

    ir = ipuxl.Ir(replication=replication)
    ir.num_host_transfers = STEPS
    w0 = np.arange(15, dtype=np.float32).reshape(5, 3) / 10.0
    with ir.main_graph, ipuxl.in_sequence():
        buffer = ipuxl.replica_sharded_buffer((5, 3), ipuxl.float32)
        w = ipuxl.remote_replica_sharded_variable(w0, buffer, 0, name="w")
        x_stream = ipuxl.h2d_stream((4, 5), ipuxl.float32, "x")
        loss_stream = ipuxl.d2h_stream((), ipuxl.float32, "loss")
        shard_stream = ipuxl.d2h_stream(buffer.tensor_shape, ipuxl.float32, "shard")

        def forward(shard, x):
            full = ops.collectives.replicated_all_gather(shard)
            y = x @ full
            return ops.sum(y * y)

        spec = ipuxl.TensorSpec(buffer.tensor_shape, ipuxl.float32, buffer.meta_shape)
        graph = ir.create_graph(forward, spec, ipuxl.TensorSpec((4, 5), ipuxl.float32))
        info = transforms.autodiff(graph, grads_required=[graph.inputs[0]])

        def step():
            shard = ops.remote_load(buffer, 0)
            x = ops.host_load(x_stream)
            fwd = ops.call_with_info(graph, shard, x)
            (grad,) = ops.call(info.graph, ipuxl.constant(np.ones((), np.float32)), inputs_dict=info.inputs_dict(fwd))
            new = shard - grad * LR
            ops.remote_store(buffer, 0, new)
            ops.host_store(loss_stream, fwd.outputs[0])
            ops.host_store(shard_stream, new)

        ops.repeat(ir.create_graph(step), STEPS)
        v, v_shard = ipuxl.replica_sharded_variable(w0, name="v")  # on-chip, sharded: doubled per run
        ops.var_updates.accumulate_(v_shard, v_shard)
    return ir, (w, v), x_stream, loss_stream, shard_stream


def data() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((STEPS, REPLICAS, 4, 5)).astype(np.float32)


def train(replication) -> dict[str, np.ndarray]:
    import ipuxl

    ir, (w, v), x_stream, loss_stream, shard_stream = build(replication)
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run({x_stream: data()})
        full, v_full = session.get_tensor_data(w).copy(), session.get_tensor_data(v).copy()
    return {"loss": out[loss_stream], "shards": out[shard_stream], "full": full, "v_full": v_full}


def test_rts_training_over_two_processes_is_bit_equal_to_one_process(tmp_path):
    run_over_processes(HERE, tmp_path, REPLICAS)
    expected = train(REPLICAS)
    for rank in range(REPLICAS):
        with np.load(tmp_path / f"rank{rank}.npz") as got:
            np.testing.assert_array_equal(got["loss"], expected["loss"], err_msg=f"rank {rank}")
            np.testing.assert_array_equal(got["shards"], expected["shards"], err_msg=f"rank {rank}")
            np.testing.assert_array_equal(got["full"], expected["full"], err_msg=f"rank {rank}")
            np.testing.assert_array_equal(got["v_full"], expected["v_full"], err_msg=f"rank {rank}")
    # in one process the host reads the full tensor from the shards (padding dropped)
    last = expected["shards"][-1]
    np.testing.assert_array_equal(expected["full"], np.concatenate(list(last))[:15].reshape(5, 3))
    np.testing.assert_array_equal(expected["v_full"], np.arange(15, dtype=np.float32).reshape(5, 3) / 10.0 * 2)


if __name__ == "__main__":
    from ipuxl.device.replicas import world

    result = train("popdist")
    np.savez(Path(sys.argv[1]) / f"rank{world()[1]}.npz", **result)
