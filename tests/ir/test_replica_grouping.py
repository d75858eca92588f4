"""``ReplicaGrouping`` from assignments (const and non-const), variable retrieval, and
``Ir(replication="popdist")``. PopXL's own examples are the oracle for the assignments."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
from ipuxl import errors


@pytest.mark.parametrize("stride, group_size, assignment", [
    (1, 8, [0] * 8), (1, 1, list(range(8))), (1, 2, [0, 0, 1, 1, 2, 2, 3, 3]),
    (2, 2, [0, 1, 0, 1, 2, 3, 2, 3]), (1, 4, [0, 0, 0, 0, 1, 1, 1, 1]), (2, 4, [0, 1, 0, 1, 0, 1, 0, 1]),
])
def test_const_groupings_and_their_assignments(stride, group_size, assignment):
    ir = ipuxl.Ir(replication=8)
    rg = ir.replica_grouping(stride, group_size)
    assert rg.assignment == assignment and rg.is_const and rg.const_rg is rg
    assert ir.replica_grouping_from_assignments(assignment) == rg
    assert (rg.to_device_map, rg.to_host_map) == (None, None)


@pytest.mark.parametrize("assignment, transpose", [
    ([0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3], [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]),
    ([0, 0, 1, 1, 0, 0, 1, 1], [0, 1, 0, 1, 2, 3, 2, 3]),
    ([0, 1, 0, 1, 2, 3, 2, 3], [0, 0, 1, 1, 0, 0, 1, 1]),
])
def test_transpose_from_assignments(assignment, transpose):
    ir = ipuxl.Ir(replication=len(assignment))
    rg = ir.replica_grouping_from_assignments(assignment)
    assert rg.transpose().assignment == transpose
    assert rg.transpose().transpose() == rg


def test_non_const_grouping_has_a_const_split_and_maps():
    ir = ipuxl.Ir(replication=8)
    rg = ir.replica_grouping_from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
    assert not rg.is_const and rg.num_groups == 2 and rg.group_size == 4
    assert rg.groups == [[0, 1, 4, 5], [2, 3, 6, 7]] and rg.members(5) == [0, 1, 4, 5]
    assert rg.const_rg.assignment == [0, 0, 1, 1, 2, 2, 3, 3] and rg.const_rg.is_const
    assert rg.to_device_map == [0, 1, 0, 1] and rg.to_host_map == [0, 1]
    assert repr(rg) == "ReplicaGrouping(assignment=[0, 0, 1, 1, 0, 0, 1, 1])"
    with pytest.raises(errors.UnsupportedError, match="no single stride") as info:
        _ = rg.stride
    assert isinstance(info.value, NotImplementedError)


@pytest.mark.parametrize("assignment, fragment", [
    ([0, 0, 1], "3 entries"), ([1, 1, 0, 0], "in order of first appearance"),
    ([0, 0, 0, 1], "one size"), ([0, 2, 0, 2], "in order of first appearance"),
])
def test_bad_assignments_are_value_errors(assignment, fragment):
    ir = ipuxl.Ir(replication=4)
    with pytest.raises(errors.ReplicationError, match=fragment) as info:
        ir.replica_grouping_from_assignments(assignment)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("mode", ["one_per_group", "all_replicas"])
def test_variable_with_a_non_const_grouping_holds_one_value_per_group(mode):
    ir = ipuxl.Ir(replication=4)
    rg = ir.replica_grouping_from_assignments([0, 1, 1, 0])
    data = np.array([[1.0, 2.0], [10.0, 20.0]], np.float32)  # group 0, group 1
    with ir.main_graph:
        v = ipuxl.variable(data, replica_grouping=rg, retrieval_mode=mode, name="v")
        ipuxl.ops.scaled_add_(v, ipuxl.constant(np.ones(2, np.float32)), b=1.0)
    assert v.retrieval_mode == mode and v.shape_on_host == (2, 2) and v.shape_on_replica == (2,)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({})
        got = torch.from_numpy(np.asarray(session.get_tensor_data(v)))
    updated = torch.from_numpy(data) + 1.0
    expected = updated if mode == "one_per_group" else updated[torch.tensor(rg.assignment)]
    torch.testing.assert_close(got, expected)


def test_ir_popdist_takes_the_replica_count_from_the_launchers_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ipuxl.Ir(replication="popdist").replication_factor == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    ir = ipuxl.Ir(replication="popdist")
    assert ir.replication_factor == 4 and ir.instance_replication_factor == 1


def test_ir_replication_of_another_string_is_refused():
    with pytest.raises(errors.InvalidArgumentError, match="positive int"):
        ipuxl.Ir(replication="all")
