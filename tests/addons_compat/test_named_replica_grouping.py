"""popxl.addons' ``named_replica_grouping``: named groupings and instance (popdist) groupings."""
from __future__ import annotations

import pytest

import ipuxl
import ipuxl.addons_compat as addons
from ipuxl.addons_compat.named_replica_grouping import get_instance_replica_grouping, is_cross_instance
from ipuxl.errors import ReplicationError


def test_named_replica_grouping_and_instance_groupings(monkeypatch):
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        groups = addons.NamedReplicaGrouping.build_groups(["fc.weight", "fc.bias"], ir.replica_grouping(group_size=2))
        everyone = addons.NamedReplicaGrouping.build_groups(["w"])
        assert groups.fc.weight.group_size == 2 and sorted(groups.to_dict()) == ["fc.bias", "fc.weight"]
        assert everyone.w.group_size == 4
        strided = ir.replica_grouping(stride=2, group_size=2)
        assert not is_cross_instance(strided)  # one process runs all 4 replicas
        assert get_instance_replica_grouping(strided) is strided
        monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: 2 replicas per process
        assert is_cross_instance(strided) and not is_cross_instance(ir.replica_grouping(group_size=2))
        within = get_instance_replica_grouping(ir.replica_grouping(group_size=4))
        assert (within.stride, within.group_size) == (1, 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    wide = ipuxl.Ir(replication=8)  # 2 replicas per process
    with wide.main_graph, pytest.raises(ReplicationError, match="stride must be < ir.instance_replication_factor"):
        get_instance_replica_grouping(wide.replica_grouping(stride=4, group_size=2))
