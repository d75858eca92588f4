"""``ReplicaGrouping``: how the replicas of an ``Ir`` are partitioned into groups.

As in PopXL, a grouping is usually a ``stride`` and a ``group_size``: the members of a
group are ``stride`` apart. With 8 replicas::

    stride 1, group_size 2 -> assignment [0, 0, 1, 1, 2, 2, 3, 3]
    stride 2, group_size 4 -> assignment [0, 1, 0, 1, 0, 1, 0, 1]
    stride 4, group_size 2 -> assignment [0, 1, 2, 3, 0, 1, 2, 3]

``Ir.replica_grouping_from_assignments`` also makes groupings without one stride
(``[0, 0, 1, 1, 0, 0, 1, 1]``): "non-const" groupings (``is_const`` False). They group
variables (one value per group) but not collectives, which need a stride.

Groupings decide which replicas a collective combines and which replicas share a
variable's value (``ipuxl.variable(..., replica_grouping=g)`` holds one value per
group).
"""
from __future__ import annotations

from collections import Counter
from functools import cached_property, reduce
from math import gcd
from typing import Sequence

from ipuxl.errors import GraphContextError, ReplicationError, UnsupportedError

__all__ = ["ReplicaGrouping"]


class ReplicaGrouping:
    """A partition of ``replication_factor`` replicas into equal groups.

    Args:
        replication_factor: the number of replicas partitioned.
        stride: offset between the members of one group (ignored when ``group_size`` is 1).
        group_size: members per group; default ``replication_factor // stride``.

    Raises:
        ReplicationError: when the groups do not tile the replicas exactly.
        GraphContextError: (a RuntimeError, as PopXL) called without a replication
            factor, as ``popxl.ReplicaGrouping()``: groupings come from ``ir.replica_grouping``.
    """

    def __init__(self, replication_factor: int | None = None, stride: int = 1, group_size: int | None = None):
        if replication_factor is None:
            raise GraphContextError("Cannot create a ReplicaGrouping directly: its replicas are those of an Ir",
                                    fix="use ir.replica_grouping(stride, group_size)")
        if group_size is None:
            group_size = max(replication_factor // max(stride, 1), 1)
        for name, value in (("stride", stride), ("group_size", group_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ReplicationError(f"replica grouping: {name} must be a positive int, got {value!r}",
                                       fix="use ir.replica_grouping(stride=1, group_size=None)")
        stride = stride if group_size > 1 else 1  # as PopXL: a stride between no members means nothing
        if replication_factor % (stride * group_size):
            raise ReplicationError(
                f"replica grouping stride={stride}, group_size={group_size} does not divide the "
                f"{replication_factor} replicas (stride x group_size = {stride * group_size} must divide "
                f"the replication factor)",
                fix=f"choose group_size among {_divisors(replication_factor // stride) or [1]} "
                    f"for stride {stride}, or change Ir(replication=...)")
        self.replication_factor = replication_factor
        self._stride: int | None = stride
        self.group_size = group_size
        span = stride * group_size
        self._assignment = [r % stride + (r // span) * stride for r in range(replication_factor)]

    @classmethod
    def from_assignment(cls, replication_factor: int, assignment: Sequence[int]) -> "ReplicaGrouping":
        """The grouping of ``Ir.replica_grouping_from_assignments`` (see there)."""
        assignment = [int(a) for a in assignment]
        _check_assignment(replication_factor, assignment)
        sizes = Counter(assignment)
        strides = _strides(assignment)
        if len(strides) <= 1:  # one stride between all members: a const grouping if it tiles the replicas
            stride = strides.pop() if strides else 1
            if replication_factor % (stride * sizes[0]) == 0:
                const = cls(replication_factor, stride, sizes[0])
                if const._assignment == assignment:
                    return const
        self = cls.__new__(cls)
        self.replication_factor, self._stride, self.group_size = replication_factor, None, sizes[0]
        self._assignment = assignment
        return self

    # -- PopXL's attributes ----------------------------------------------------------------
    @property
    def stride(self) -> int:
        """Offset between the members of one group.

        Raises:
            UnsupportedError: (a NotImplementedError) a non-const grouping has none.
        """
        if self._stride is None:
            raise UnsupportedError(f"{self} has no single stride, so it cannot group a collective",
                                   fix="use ir.replica_grouping(stride, group_size) for collectives")
        return self._stride

    @property
    def is_const(self) -> bool:
        """True when the grouping is a stride and group size (PopXL: it has a PopART representation)."""
        return self._stride is not None

    @property
    def num_groups(self) -> int:
        return self.replication_factor // self.group_size

    @property
    def assignment(self) -> list[int]:
        """The group index of each replica."""
        return list(self._assignment)

    @cached_property
    def const_rg(self) -> "ReplicaGrouping":
        """The const grouping with fewest groups that splits each group of this one (itself when const).

        ``[0, 0, 1, 1, 0, 0, 1, 1]`` -> ``[0, 0, 1, 1, 2, 2, 3, 3]``.
        """
        if self.is_const:
            return self
        stride = min(_strides(self._assignment))
        split = list(self._assignment)
        next_group = max(split) + 1
        for members in self.groups:  # a larger gap starts a new group for the rest
            moved = False
            for before, after in zip(members, members[1:]):
                if after - before > stride:
                    moved, next_group = True, next_group + 1
                if moved:
                    split[after] = next_group - 1
        size = reduce(gcd, Counter(split).values())
        return ReplicaGrouping(self.replication_factor, stride if size > 1 else 1, size)

    @property
    def to_device_map(self) -> list[int] | None:
        """For each group of ``const_rg``, the group of this grouping it belongs to (None when const)."""
        return None if self.is_const else _first_seen(self.const_rg.assignment, self._assignment)

    @property
    def to_host_map(self) -> list[int] | None:
        """For each group of this grouping, its first group in ``const_rg`` (None when const)."""
        return None if self.is_const else _first_seen(self._assignment, self.const_rg.assignment)

    @cached_property
    def groups(self) -> list[list[int]]:
        """The members of each group, in replica order."""
        members: list[list[int]] = [[] for _ in range(self.num_groups)]
        for replica, group in enumerate(self._assignment):
            members[group].append(replica)
        return members

    def members(self, replica: int) -> list[int]:
        """The replicas in ``replica``'s group (itself included), in order."""
        return self.groups[self._assignment[replica]]

    def transpose(self) -> "ReplicaGrouping":
        """The grouping whose group ``i`` holds the ``i``-th member of every group of this one.

        ``[0, 0, 1, 1] -> [0, 1, 0, 1]``; ``[0, 1, 0, 1, 2, 3, 2, 3] -> [0, 0, 1, 1, 0, 0, 1, 1]``.
        """
        assignment = [0] * self.replication_factor
        for group in self.groups:
            for position, replica in enumerate(group):
                assignment[replica] = position
        # number the new groups by first appearance, as from_assignment requires
        order = {g: i for i, g in enumerate(dict.fromkeys(assignment))}
        return ReplicaGrouping.from_assignment(self.replication_factor, [order[g] for g in assignment])

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        return (self.replication_factor, tuple(self._assignment))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplicaGrouping) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        if self.is_const:
            return (f"ReplicaGrouping(num_replicas={self.replication_factor}, stride={self._stride}, "
                    f"group_size={self.group_size}, num_groups={self.num_groups})")
        return f"ReplicaGrouping(assignment={self._assignment})"


def _check_assignment(replication_factor: int, assignment: list[int]) -> None:
    fix = "give one group index per replica, numbering groups 0, 1, ... in order of first appearance"
    if len(assignment) != replication_factor:
        raise ReplicationError(f"replica grouping: the assignment has {len(assignment)} entries, the Ir has "
                               f"{replication_factor} replicas", fix=fix)
    first_seen = list(dict.fromkeys(assignment))
    if first_seen != list(range(len(first_seen))):
        raise ReplicationError(f"replica grouping: groups must be numbered 0, 1, ... in order of first "
                               f"appearance, got {assignment}", fix=fix)
    sizes = Counter(assignment)
    if len(set(sizes.values())) != 1:
        raise ReplicationError(f"replica grouping: all groups must have one size, got sizes "
                               f"{dict(sorted(sizes.items()))} for assignment {assignment}", fix=fix)


def _strides(assignment: list[int]) -> set[int]:
    """Every gap between consecutive members of a group."""
    last: dict[int, int] = {}
    found = set()
    for replica, group in enumerate(assignment):
        if group in last:
            found.add(replica - last[group])
        last[group] = replica
    return found


def _first_seen(keys: list[int], values: list[int]) -> list[int]:
    """For each key in order of first appearance, the value beside its first appearance."""
    found: dict[int, int] = {}
    for key, value in zip(keys, values):
        found.setdefault(key, value)
    return list(found.values())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
