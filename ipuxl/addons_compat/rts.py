"""popxl.addons' ``rts``: replicated tensor sharding (RTS) helpers.

A replica-sharded tensor is the flat 1-D slice one replica of a group holds of a
whole tensor; its ``meta_shape`` records the whole shape. These helpers make graphs
that reduce gradients into shards (reduce-scatter, or all-reduce then slice) and that
gather shards back into whole tensors (all-gather), over named tensors.

Where upstream differs: popxl.addons splits a group that spans several host instances
("ILDs") into an in-instance collective and a second cross-instance stage, using
custom strided collectives. ipuxl's collectives already span every replica of the
``Ir``, in one process or across torchrun processes, so one collective over the group
gives the same values; ``use_io_tiles`` is accepted and has no effect (the simulated
device has no IO tiles).
"""
from __future__ import annotations

import math
from typing import Callable

from ipuxl.addons_compat.bound_args import SubsetBindGraph
from ipuxl.addons_compat.graph import GraphWithNamedArgs
from ipuxl.addons_compat.named_replica_grouping import NamedReplicaGrouping
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir import context
from ipuxl.ir.context import in_sequence
from ipuxl.ir.graph_builder import graph_input, graph_output
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor, TensorSpec
from ipuxl.ops import collectives
from ipuxl.ops.collectives import CollectiveOps

__all__ = ["all_gather_replica_sharded_graph", "reduce_replica_sharded_graph", "reduce_replica_sharded_tensor",
           "gather_replica_sharded_tensor", "replica_sharded_spec"]


def replica_sharded_spec(t: Tensor | TensorSpec, shard_over: ReplicaGrouping | int | None = None) -> TensorSpec:
    """The spec of ``t``'s shard when sharded over ``shard_over`` replicas (a grouping's
    group size, or a count; default all replicas).

    ``t``'s own spec when it is already sharded (has a meta shape), when the group has
    one replica, or when the group size does not divide its element count, as upstream.
    """
    count = _shard_count(shard_over)
    spec = TensorSpec(t.spec.shape, t.spec.dtype, t.meta_shape) if isinstance(t, Tensor) else t
    nelms = math.prod(spec.shape)
    if spec.meta_shape or count == 1 or nelms % count:
        return spec
    return TensorSpec((nelms // count,), spec.dtype, tuple(spec.shape))


def _shard_count(shard_over: ReplicaGrouping | int | None) -> int:
    if shard_over is None:
        return context.gcg().ir.replica_grouping().group_size
    if isinstance(shard_over, ReplicaGrouping):
        return shard_over.group_size
    if isinstance(shard_over, int) and not isinstance(shard_over, bool) and shard_over >= 1:
        return shard_over
    raise InvalidArgumentError(f"replica_sharded_spec: shard_over must be a ReplicaGrouping or a positive int, "
                               f"got {shard_over!r}", where=context.user_source_line(),
                               fix="pass ir.replica_grouping(group_size=n) or the number of replicas")


def gather_replica_sharded_tensor(t: Tensor, use_io_tiles: bool = False,
                                  replica_group: ReplicaGrouping | None = None) -> Tensor:
    """All-gather a replica-sharded ``t`` over ``replica_group`` (default: all replicas)
    into its whole shape; a tensor without a meta shape is returned unchanged."""
    if not t.meta_shape:
        return t
    return collectives.replicated_all_gather(t, group=replica_group or context.gcg().ir.replica_grouping())


def reduce_replica_sharded_tensor(t: Tensor, op: CollectiveOps = "add", replica_group: ReplicaGrouping | None = None,
                                  shard_group: ReplicaGrouping | None = None) -> Tensor:
    """Reduce ``t`` with ``op`` over ``replica_group`` (default: all replicas) and keep
    this replica's shard of it in ``shard_group`` (default: ``replica_group``).

    Equal groups give one reduce-scatter; otherwise an all-reduce over the replica group
    then a slice in the shard group. A shard group of one replica, or one whose size
    does not divide ``t``'s element count, gives the whole reduced tensor (no sharding).
    """
    ir = context.gcg().ir
    replica_group = replica_group or ir.replica_grouping()
    shard_group = shard_group or replica_group
    if shard_group.group_size > 1 and t.nelms % shard_group.group_size == 0:
        if replica_group == shard_group:
            return collectives.replicated_reduce_scatter(t, op, replica_group,
                                                         configure_output_for_replicated_tensor_sharding=True)
        if replica_group.group_size > 1:
            t = collectives.replicated_all_reduce(t, op, replica_group)
        return collectives.replica_sharded_slice(t, group=shard_group)
    return collectives.replicated_all_reduce(t, op, replica_group)


def all_gather_replica_sharded_graph(tensors: NamedTensors, use_io_tiles: bool = False,
                                     replica_groups: NamedReplicaGrouping | None = None
                                     ) -> tuple[GraphWithNamedArgs, list[str]]:
    """A graph with a named input per tensor of ``tensors`` whose outputs are the
    inputs all-gathered (sharded ones; others pass through), in sorted name order.

    Usage::

        g, names = all_gather_replica_sharded_graph(shards)
        whole = NamedTensors.pack(names, g.bind(shards).call())

    Args:
        tensors: the (sharded) tensors; only their specs are used.
        use_io_tiles: accepted for compatibility; no effect.
        replica_groups: the group to gather each tensor over (default: all replicas).
    """
    groups = _groups_by_name(tensors, replica_groups, "replica_groups")
    return _per_tensor_graph(tensors, "all_gather",
                             lambda name, t: gather_replica_sharded_tensor(t, use_io_tiles, groups[name]))


def reduce_replica_sharded_graph(tensors: NamedTensors, op: CollectiveOps = "add", use_io_tiles: bool = False,
                                 shard_groups: NamedReplicaGrouping | None = None,
                                 replica_group: ReplicaGrouping | None = None) -> tuple[GraphWithNamedArgs, list[str]]:
    """A graph with a named input per tensor of ``tensors`` whose outputs are the inputs
    reduced with ``op`` over ``replica_group`` and sharded in each one's shard group
    (see ``reduce_replica_sharded_tensor``), in sorted name order.

    Usage::

        g, names = reduce_replica_sharded_graph(grads, "mean", shard_groups=groups)
        shards = NamedTensors.pack(names, g.bind(grads).call())

    Args:
        tensors: the tensors to reduce; only their specs are used.
        op: the reduction (``add``, ``mean``, ...).
        use_io_tiles: accepted for compatibility; no effect.
        shard_groups: the group to shard each tensor in (default: all replicas).
        replica_group: the group to reduce over (default: all replicas).
    """
    groups = _groups_by_name(tensors, shard_groups, "shard_groups")
    return _per_tensor_graph(tensors, "replica_reduce", lambda name, t: reduce_replica_sharded_tensor(
        t, op, replica_group=replica_group, shard_group=groups[name]))


def _per_tensor_graph(tensors: NamedTensors, graph_name: str,
                      output: Callable[[str, Tensor], Tensor]) -> tuple[GraphWithNamedArgs, list[str]]:
    """A graph with an input per tensor of ``tensors`` (its spec and meta shape) and, per
    input, the output ``output(name, input)``; and the names, in sorted order."""
    graph = context.gcg().ir.create_empty_graph(graph_name)
    names: list[str] = []
    args: dict[str, Tensor] = {}
    with graph, in_sequence(False):
        for name, tensor in zip(*tensors.unpack()):
            args[name] = graph_input(tensor.shape, tensor.dtype, tensor.name, meta_shape=tensor.meta_shape)
            names.append(name)
            graph_output(output(name, args[name]))
    return SubsetBindGraph(graph, NamedTensors.from_dict(args)), names


def _groups_by_name(tensors: NamedTensors, groups: NamedReplicaGrouping | None,
                    argument: str) -> dict[str, ReplicaGrouping]:
    """``groups`` as a dict, defaulting to all replicas; every tensor name must have one."""
    names = list(tensors.to_dict())
    if groups is None:
        groups = NamedReplicaGrouping.build_groups(names, context.gcg().ir.replica_grouping())
    by_name = groups.to_dict()
    missing = [n for n in names if n not in by_name]
    if missing:
        raise InvalidArgumentError(f"{argument} has no replica grouping for {missing}",
                                   where=context.user_source_line(),
                                   fix=f"give {argument} one grouping per tensor name, e.g. "
                                       "NamedReplicaGrouping.build_groups(names, group)")
    return by_name
