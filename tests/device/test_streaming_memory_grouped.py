"""Variables sharded inside replica groups (``shard_over`` smaller than the group), gathered
and re-sliced over a sub-group, in one process and over torchrun processes.

This is the shape of PopXL's "complex" distributed RTS program: a variable with one value per
group of ``replica_grouping`` is sharded over ``shard_over`` replicas of its group; the program
gathers each shard set over the matching sub-group (passing the grouping in second place, as
PopXL 3.0-3.2's ``replicated_all_gather(t, group)`` did), adds one, slices its shard back out
and copies it into the variable. The host read must be the full per-group data plus one, in
every process. Also here: a variable with one group per replica, read from every process.
The processes run this file as a script.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.device._torchrun import run_over_processes

HERE = Path(__file__).resolve()
PROCESSES = 4
ELEMENTS = 12


def run(replication, group_size: int, stride: int, shard_over: int) -> dict[str, np.ndarray]:
    import ipuxl
    import ipuxl.ops as ops

    ir = ipuxl.Ir(replication=replication)
    grouping = ir.replica_grouping(group_size=group_size, stride=stride)
    data = np.arange(grouping.num_groups * ELEMENTS, dtype=np.int32).reshape(grouping.num_groups, ELEMENTS)
    per_replica = np.arange(ir.replication_factor * 3, dtype=np.float32).reshape(ir.replication_factor, 3)
    with ir.main_graph:
        handle, shard = ipuxl.replica_sharded_variable(data, replica_grouping=grouping, shard_over=shard_over)
        sub_group = ir.replica_grouping(group_size=shard_over, stride=stride)  # the replicas of one shard set
        gathered = ops.collectives.replicated_all_gather(shard, sub_group)  # grouping in second place
        gathered += 1
        ops.var_updates.copy_var_update_(shard, ops.collectives.replica_sharded_slice(gathered, sub_group))
        own = ipuxl.variable(per_replica, replica_grouping=ir.replica_grouping(group_size=1), name="own")
        own += 0.5
    with ipuxl.Session(ir, "cpu") as session:
        session.run()
        return {"sharded": session.get_tensor_data(handle).copy(), "own": session.get_tensor_data(own).copy(),
                "data": data, "per_replica": per_replica}


def check(result: dict[str, np.ndarray]) -> None:
    torch.testing.assert_close(result["sharded"], result["data"] + 1)
    torch.testing.assert_close(result["own"], result["per_replica"] + 0.5)


@pytest.mark.parametrize("replicas, group_size, stride, shard_over", [
    (16, 4, 4, 2),  # PopXL's scenario: 4 groups of 4 (stride 4), each sharded over 2 replicas
    (4, 2, 2, 2),
    (8, 4, 1, 4),
])
def test_sharding_inside_groups_gathers_to_each_groups_data_plus_one(replicas, group_size, stride, shard_over):
    check(run(replicas, group_size, stride, shard_over))


def test_over_processes_every_process_reads_every_groups_value(tmp_path):
    run_over_processes(HERE, tmp_path, PROCESSES)
    want = run(PROCESSES, 2, 2, 2)
    for rank in range(PROCESSES):
        with np.load(tmp_path / f"rank{rank}.npz") as got:
            check(dict(got))
            for key in ("sharded", "own"):
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"rank {rank}: {key}")


def test_a_grouping_given_twice_or_a_non_int_axis_is_refused():
    import ipuxl
    import ipuxl.ops as ops
    from ipuxl.errors import InvalidArgumentError

    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        x = ipuxl.variable(np.zeros(3, np.float32))
        with pytest.raises(InvalidArgumentError, match="two replica groupings"):
            ops.collectives.replicated_all_gather(x, ir.replica_grouping(), group=ir.replica_grouping())
        with pytest.raises(InvalidArgumentError, match="axis must be an int, got str"):
            ops.collectives.replicated_all_gather(x, "0")
        with pytest.raises(InvalidArgumentError, match="replicated_slice: axis must be an int, got float"):
            ops.collectives.replicated_slice(x, 0.0)
        assert ops.collectives.replicated_slice(x, ir.replica_grouping(group_size=1)).shape == (3,)


def test_an_op_argument_the_generated_code_cannot_write_is_refused_when_built():
    """Arguments become Python source in the generated program: an object there would name
    nothing and fail only when the program runs, so building the op refuses it."""
    import ipuxl
    from ipuxl.errors import InvalidArgumentError
    from ipuxl.ir.build import emit

    class Setting:
        pass

    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros(3, np.float32))
        with pytest.raises(InvalidArgumentError, match=r"op 'scaled' got an argument of type Setting"):
            emit("scaled", torch.mul, (x, Setting()), meta_fn=lambda t, _: torch.empty_like(t))
        y = emit("scaled", torch.mul, (x, 2.0))  # numbers are fine
    assert y.shape == (3,)


if __name__ == "__main__":
    from ipuxl.device.replicas import world

    np.savez(Path(sys.argv[1]) / f"rank{world()[1]}.npz", **run("popdist", 2, 2, 2))
