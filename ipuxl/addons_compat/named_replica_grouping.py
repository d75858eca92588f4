"""popxl.addons' ``NamedReplicaGrouping``: a ``DotTree`` of ``ReplicaGrouping``s, and
helpers restricting a grouping to the replicas of one process (instance) or of one IPU
Link Domain (ILD: the IPUs joined by IPU-Links, at most 64 by default).

The ILD size is read as upstream: ``ipuLinkDomainSize`` in the ``POPLAR_TARGET_OPTIONS``
environment variable (JSON), else ``min(replication_factor, 64)`` (logged once when the
program runs as several instances).
"""
from __future__ import annotations

import json
import logging
import os
from typing import TypeVar

from ipuxl.addons_compat.dot_tree import DotTree
from ipuxl.errors import ReplicationError
from ipuxl.ir import context
from ipuxl.ir.replica_grouping import ReplicaGrouping

__all__ = ["NamedReplicaGrouping", "fill_none_group", "get_instance_replica_grouping", "is_cross_instance",
           "get_ild_size_from_popdist", "get_ild_replica_grouping", "is_cross_ild"]

CLS = TypeVar("CLS", bound="NamedReplicaGrouping")


def fill_none_group(rg: ReplicaGrouping | None, none_value: ReplicaGrouping) -> ReplicaGrouping:
    """``rg``, or ``none_value`` when it is None."""
    return none_value if rg is None else rg


class NamedReplicaGrouping(DotTree[ReplicaGrouping]):
    """Replica groupings by (dotted) name, e.g. one per variable of a model."""

    @classmethod
    def build_groups(cls: type[CLS], names: list[str], value: ReplicaGrouping | None = None) -> CLS:
        """``value`` (default: all replicas in one group) under each of ``names``."""
        value = value or context.gcg().ir.replica_grouping()
        return cls.pack(names, [value] * len(names))


def is_cross_instance(replica_grouping: ReplicaGrouping) -> bool:
    """Whether the grouping's groups span replicas of more than one instance (process)."""
    ir = context.gcg().ir
    return replica_grouping.group_size * replica_grouping.stride > ir.instance_replication_factor


def get_instance_replica_grouping(replica_grouping: ReplicaGrouping | None = None) -> ReplicaGrouping:
    """The grouping with the same stride restricted to the replicas of one instance.

    Raises:
        ReplicationError: (a ValueError) the stride is larger than the instance's replica count.
    """
    ir = context.gcg().ir
    replica_grouping = replica_grouping or ir.replica_grouping()
    if replica_grouping.stride > ir.instance_replication_factor:
        raise ReplicationError(
            f"replica grouping stride must be < ir.instance_replication_factor: stride {replica_grouping.stride}, "
            f"instance replication factor {ir.instance_replication_factor}", where=context.user_source_line(),
            fix="use a stride of at most the replicas one process runs")
    if is_cross_instance(replica_grouping):
        return ir.replica_grouping(stride=replica_grouping.stride,
                                   group_size=ir.instance_replication_factor // replica_grouping.stride)
    return replica_grouping


_warned_ild_size = False


def get_ild_size_from_popdist() -> int:
    """The IPU Link Domain size: ``POPLAR_TARGET_OPTIONS``' ``ipuLinkDomainSize``, else
    ``min(replication_factor, 64)``."""
    global _warned_ild_size
    size = json.loads(os.environ.get("POPLAR_TARGET_OPTIONS", "{}")).get("ipuLinkDomainSize")
    if size is not None:
        return int(size)
    size = min(context.gcg().ir.replication_factor, 64)
    if not _warned_ild_size and ("WORLD_SIZE" in os.environ or "POPDIST_NUM_TOTAL_REPLICAS" in os.environ):
        _warned_ild_size = True
        logging.warning(f"Could not read IPU link domain size from enviroment. Assuming {size}.")
    return size


def is_cross_ild(replica_grouping: ReplicaGrouping) -> bool:
    """Whether the grouping's groups span more than one IPU Link Domain."""
    return replica_grouping.group_size * replica_grouping.stride > get_ild_size_from_popdist()


def get_ild_replica_grouping(replica_grouping: ReplicaGrouping | None = None) -> ReplicaGrouping:
    """The grouping with the same stride restricted to the replicas of one ILD (default: all
    replicas of an ILD).

    Raises:
        ReplicationError: (a ValueError) the stride is larger than the ILD size.
    """
    ir = context.gcg().ir
    replica_grouping = replica_grouping or ir.replica_grouping()
    ild_size = get_ild_size_from_popdist()
    if replica_grouping.stride > ild_size:
        raise ReplicationError(
            f"replica grouping stride must be < IPU Link Domain size: stride {replica_grouping.stride}, ILD size "
            f"{ild_size}", where=context.user_source_line(),
            fix="use a stride of at most the ILD size (POPLAR_TARGET_OPTIONS' ipuLinkDomainSize)")
    if is_cross_ild(replica_grouping):
        return ir.replica_grouping(stride=replica_grouping.stride, group_size=ild_size // replica_grouping.stride)
    return replica_grouping
