"""``ReplicaGrouping``: how the replicas of an ``Ir`` are partitioned into groups.

As in PopXL, a grouping is a ``stride`` and a ``group_size``: the members of a group
are ``stride`` apart. With 8 replicas::

    stride 1, group_size 2 -> assignment [0, 0, 1, 1, 2, 2, 3, 3]
    stride 2, group_size 4 -> assignment [0, 1, 0, 1, 0, 1, 0, 1]
    stride 4, group_size 2 -> assignment [0, 1, 2, 3, 0, 1, 2, 3]

Groupings decide which replicas a collective combines and which replicas share a
variable's value (``ipuxl.variable(..., replica_grouping=g)`` holds one value per
group).
"""
from __future__ import annotations

from functools import cached_property

from ipuxl.errors import ReplicationError

__all__ = ["ReplicaGrouping"]


class ReplicaGrouping:
    """A partition of ``replication_factor`` replicas into equal groups.

    Args:
        replication_factor: the number of replicas partitioned.
        stride: offset between the members of one group.
        group_size: members per group; default ``replication_factor // stride``.

    Raises:
        ReplicationError: when the groups do not tile the replicas exactly.
    """

    def __init__(self, replication_factor: int, stride: int = 1, group_size: int | None = None):
        if group_size is None:
            group_size = max(replication_factor // max(stride, 1), 1)
        for name, value in (("stride", stride), ("group_size", group_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ReplicationError(f"replica grouping: {name} must be a positive int, got {value!r}",
                                       fix="use ir.replica_grouping(stride=1, group_size=None)")
        if replication_factor % (stride * group_size):
            raise ReplicationError(
                f"replica grouping stride={stride}, group_size={group_size} does not divide the "
                f"{replication_factor} replicas (stride x group_size = {stride * group_size} must divide "
                f"the replication factor)",
                fix=f"choose group_size among {_divisors(replication_factor // stride) or [1]} "
                    f"for stride {stride}, or change Ir(replication=...)")
        self.replication_factor = replication_factor
        self.stride = stride
        self.group_size = group_size

    @property
    def num_groups(self) -> int:
        return self.replication_factor // self.group_size

    @cached_property
    def assignment(self) -> list[int]:
        """The group index of each replica."""
        span = self.stride * self.group_size
        return [r % self.stride + (r // span) * self.stride for r in range(self.replication_factor)]

    @cached_property
    def groups(self) -> list[list[int]]:
        """The members of each group, in replica order."""
        members: list[list[int]] = [[] for _ in range(self.num_groups)]
        for replica, group in enumerate(self.assignment):
            members[group].append(replica)
        return members

    def members(self, replica: int) -> list[int]:
        """The replicas in ``replica``'s group (itself included), in order."""
        return self.groups[self.assignment[replica]]

    def transpose(self) -> "ReplicaGrouping":
        """The grouping whose groups take one member from each group of this one."""
        if self.num_groups == 1:
            return ReplicaGrouping(self.replication_factor, 1, 1)
        if self.stride == 1:
            return ReplicaGrouping(self.replication_factor, self.group_size, self.num_groups)
        if self.stride * self.group_size == self.replication_factor:
            return ReplicaGrouping(self.replication_factor, 1, self.stride)
        raise ReplicationError(f"{self} has no transpose expressible as a stride and group size",
                               fix="use a grouping with stride 1, or with stride x group_size = replicas")

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.replication_factor, self.stride, self.group_size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplicaGrouping) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return (f"ReplicaGrouping(num_replicas={self.replication_factor}, stride={self.stride}, "
                f"group_size={self.group_size})")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
