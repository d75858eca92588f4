"""The replica plan: how an ``Ir(replication=R)`` runs as R data-parallel replicas.

The program itself is not rewritten: every replica runs the same compiled code
with its own variables and its own slice of every host stream, and the collective
ops in the program are where replicas meet (``ipuxl.device.replicas``). The plan
(made by the ``Session`` before compiling) says what each process runs, after
checking that the program fits the replica count:

- the processes (``torchrun``'s world, or just this one) split the R replicas into
  equal consecutive blocks, so the world size must divide R (a program with one
  replica is not split: each process runs its own copy, e.g. an evaluation);
- every collective's group (stride x group size) must divide R, and no TP all-reduce
  with identical inputs is left (popxl.addons' patterns make them identities);
- each replica's initial variable values follow the variable's replica grouping
  (one value per group, or the same value everywhere).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from ipuxl.errors import PatternNotAppliedError, ReplicationError
from ipuxl.ir.ir import Ir, VariableRecord
from ipuxl.ir.meta import COLLECTIVE_OPS, OP, SOURCE
from ipuxl.ir.world import world
from ipuxl.kernels import tp_collectives

__all__ = ["ReplicaPlan", "plan_replicas"]


@dataclass(frozen=True)
class ReplicaPlan:
    """Which replicas this process runs."""

    replication_factor: int
    processes: int
    rank: int

    @property
    def local(self) -> list[int]:
        per = self.replication_factor // self.processes
        return list(range(self.rank * per, (self.rank + 1) * per))

    @property
    def distributed(self) -> bool:
        return self.processes > 1

    def initial_value(self, record: VariableRecord, replica: int) -> np.ndarray:
        """Replica ``replica``'s initial value of a variable."""
        grouping = record.replica_grouping(self.replication_factor)
        return np.asarray(record.data[grouping.assignment[replica]]) if grouping.num_groups > 1 else record.data


def plan_replicas(ir: Ir) -> ReplicaPlan:
    """Check ``ir`` against its replica count and this process's world; return the plan.

    Raises:
        ReplicationError: the world size does not divide R, or a collective's group
            does not divide R.
    """
    replicas = ir.replication_factor
    processes, rank = world()
    if replicas == 1:  # not replicated: under torchrun every process runs its own copy
        processes, rank = 1, 0
    if replicas % processes:
        raise ReplicationError(
            f"torchrun started {processes} processes but the program has {replicas} replicas; "
            f"each process must run the same number of replicas",
            where=f"process {rank} of {processes}, {ir!r}",
            fix=f"launch with --nproc_per_node among {[d for d in range(1, replicas + 1) if replicas % d == 0]} "
                f"(times the number of nodes), or change the replication factor")
    for graph in ir.graphs:
        for node in graph.fx.nodes:
            if node.meta.get(OP) in COLLECTIVE_OPS:
                _refuse_identity_candidate(graph.name, node)
                stride, size = _group_args(node)
                if replicas % (stride * size):
                    raise ReplicationError(
                        f"{node.meta[OP]} in graph '{graph.name}' uses a group of size {size} with "
                        f"stride {stride}, which does not divide the {replicas} replicas",
                        where=node.meta.get(SOURCE),
                        fix="build the group with ir.replica_grouping(...) of this Ir's replication factor")
    for record in ir.variable_records.values():
        if record.grouping is not None and record.grouping.replication_factor != replicas:
            raise ReplicationError(
                f"variable '{record.tensor.name}' has {record.grouping}, the Ir has {replicas} replicas",
                where=record.tensor.node.meta.get(SOURCE),
                fix="set the Ir's replication factor before creating variables with replica groupings")
    return ReplicaPlan(replicas, processes, rank)


def _refuse_identity_candidate(graph_name: str, node: fx.Node) -> None:
    """A TP all-reduce with identical inputs must have become an identity (PopART refuses to
    lower one: ``ipuxl.kernels.tp_collectives``)."""
    if tp_collectives.can_be_replaced_by_identity(node.target, tuple(node.args)):
        raise PatternNotAppliedError(
            f"{node.meta[OP]} '{node.name}' in graph '{graph_name}' has identical inputs and must be an identity: "
            f"{tp_collectives.PATTERN_NEEDED}", where=node.meta.get(SOURCE),
            fix="call popxl_addons.patterns.apply_pre_alias_patterns(ir) (level 'default' or 'all') after autodiff "
                "and before creating the Session")


def _group_args(node: fx.Node) -> tuple[int, int]:
    """(stride, group_size) of a collective node (see ``ipuxl.ops.collectives``)."""
    first = 3 if node.meta[OP] == "replicated_all_gather" else 2  # (t, axis, mode, stride, size, meta_shape)
    stride, size = node.args[first:first + 2]  # else (t, op, stride, size)
    assert isinstance(stride, int) and isinstance(size, int), "ops.collectives records ints"
    return stride, size
