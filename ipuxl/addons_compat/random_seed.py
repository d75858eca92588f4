"""popxl.addons' ``seed_variable``: a random seed held in a variable, one per replica group."""
from __future__ import annotations

from ipuxl.dtypes import uint32
from ipuxl.ir import context
from ipuxl.ir.graph_builder import variable
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor, Variable
from ipuxl.ops.random import create_seeds

__all__ = ["seed_variable"]


def seed_variable(seed: int, replica_grouping: ReplicaGrouping | None = None) -> tuple[Variable, Tensor]:
    """A ``(2,)`` uint32 seed variable: replicas of one group share a seed, groups differ.

    Args:
        seed: the host seed the groups' seeds derive from (``create_seeds``).
        replica_grouping: default: every replica its own group.

    Returns:
        The variable (read or write it with the ``Session``) and the tensor to pass to
        ops. Upstream loads the tensor from a remote buffer; here both are the variable.
    """
    ir = context.gcg().ir
    replica_grouping = replica_grouping or ir.replica_grouping(group_size=1)
    seeds = create_seeds(seed, replicas=replica_grouping.num_groups)
    seed_v = variable(seeds, uint32, name="random_seed", replica_grouping=replica_grouping)
    return seed_v, seed_v
