"""Host reads of replica-sharded and replica-grouped variables under torchrun, around writes and runs.

Each process holds only its own replicas' shards; the others' come from the gather at the
end of each run. Reads before any run are the initial value (the device holds it), and a
write (``write_variable_data`` or ``weights_from_host``) is what a later ``weights_to_host``
reads back until the next run, not a mix of the new local shard and other processes'
shards from before the write. The same holds for a variable with one group per replica
(each process runs one group) and for an "all_replicas" variable. The processes run this file as a script; one process with
in-process replicas must read exactly the same values.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tests.device._torchrun import run_over_processes

HERE = Path(__file__).resolve()
REPLICAS = 2
W0 = np.arange(15, dtype=np.float32).reshape(5, 3) / 10.0
G0 = W0[:REPLICAS] * 10.0


def build(replication):
    import ipuxl
    import ipuxl.ops as ops

    ir = ipuxl.Ir(replication=replication)
    with ir.main_graph, ipuxl.in_sequence():
        buffer = ipuxl.replica_sharded_buffer((5, 3), ipuxl.float32)
        w = ipuxl.remote_replica_sharded_variable(W0, buffer, 0, name="w")  # +1 per run
        ops.remote_store(buffer, 0, ops.remote_load(buffer, 0) + 1.0)
        v, v_shard = ipuxl.replica_sharded_variable(W0 * 3.0, name="v")  # on-chip: doubled per run
        ops.var_updates.accumulate_(v_shard, v_shard)
        g = ipuxl.variable(G0, replica_grouping=ir.replica_grouping(group_size=1), name="g")  # a row per group
        g += 1.0
        a = ipuxl.variable(W0[0], retrieval_mode="all_replicas", name="a")  # a row per replica
        a += 2.0
    return ir, {"w": w, "v": v, "g": g, "a": a}


def reads(replication) -> dict[str, np.ndarray]:
    """The host values of the variables at each point of the sequence, as copies."""
    import ipuxl

    ir, variables = build(replication)
    w, v = variables["w"], variables["v"]
    out: dict[str, np.ndarray] = {}

    def snap(key: str) -> None:
        for name, tensor in variables.items():
            out[f"{key}_{name}"] = session.get_tensor_data(tensor).copy()

    with ipuxl.Session(ir, "cpu") as session:
        snap("initial")
        session.weights_to_host()  # explicit: before any run it reads the initial value too
        snap("initial_synced")
        session.run()
        snap("run1")
        session.write_variable_data(w, np.full((5, 3), -1.0, np.float32))
        session.write_variable_data(v, np.full((5, 3), 5.0, np.float32))
        session.weights_to_host()
        snap("written")
        session.get_tensor_data(v)[...] = 7.0  # PopXL's pattern: edit the host buffer, then push it
        session.weights_from_host()
        session.weights_to_host()
        snap("pushed")
        session.run()
        snap("run2")
    return out


def expected() -> dict[str, np.ndarray]:
    full = lambda value: np.full((5, 3), value, np.float32)  # noqa: E731
    a0 = np.stack([W0[0]] * REPLICAS)
    want = {"initial_w": W0, "initial_v": W0 * 3.0, "initial_synced_w": W0, "initial_synced_v": W0 * 3.0,
            "run1_w": W0 + 1.0, "run1_v": W0 * 6.0, "written_w": full(-1.0), "written_v": full(5.0),
            "pushed_w": full(-1.0), "pushed_v": full(7.0), "run2_w": full(0.0), "run2_v": full(14.0)}
    for key, runs in (("initial", 0), ("initial_synced", 0), ("run1", 1), ("written", 1), ("pushed", 1), ("run2", 2)):
        want[f"{key}_g"], want[f"{key}_a"] = G0 + runs, a0 + 2.0 * runs
    return want


def test_in_process_replicas_read_the_written_and_trained_values():
    got, want = reads(REPLICAS), expected()
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, err_msg=key)


def test_sharded_host_reads_over_two_processes_equal_one_process(tmp_path):
    run_over_processes(HERE, tmp_path, REPLICAS)
    want = reads(REPLICAS)
    for rank in range(REPLICAS):
        with np.load(tmp_path / f"rank{rank}.npz") as got:
            assert set(got.files) == set(want)
            for key, value in want.items():
                np.testing.assert_array_equal(got[key], value, err_msg=f"rank {rank}: {key}")


if __name__ == "__main__":
    from ipuxl.device.replicas import world

    result = reads("popdist")
    np.savez(Path(sys.argv[1]) / f"rank{world()[1]}.npz", **result)
