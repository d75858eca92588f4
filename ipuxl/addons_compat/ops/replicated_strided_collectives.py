"""popxl.addons' strided collectives (``popxl_addons.ops.replicated_strided_collectives``).

popxl.addons added these before PopXL's own collectives took a ``ReplicaGrouping``; they
are PopXL's collectives over a group (stride and group size), with popxl.addons' shapes:

- ``replicated_all_gather_strided(t, group)``: the members' ``t`` flattened and joined,
  reshaped to ``t.meta_shape`` when ``t`` is a shard; differentiable (a reduce-scatter).
- ``replicated_reduce_scatter_strided(t, op, group, ...)``: member ``i``'s 1-D slice of the
  reduction.
- ``replicated_all_reduce_strided`` and its ``identical_inputs`` / ``identical_grad_inputs``
  forms: the tensor-parallel all-reduces (``replicated_all_reduce_TP``), with the same
  gradient rules and the same need for ``apply_pre_alias_patterns``;
  ``replicated_all_reduce_strided_graph``: a graph reducing a tree of tensors.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

from ipuxl.addons_compat.graph import GraphWithNamedArgs
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.ops.replicated_all_reduce_TP import all_reduce_tp
from ipuxl.ir import context, placement
from ipuxl.ir.graph_builder import graph_input, graph_output
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor
from ipuxl.ops import collectives, io_tile_copy
from ipuxl.ops.collectives import CollectiveOps

__all__ = ["replicated_all_gather_strided", "replicated_reduce_scatter_strided", "replicated_all_reduce_strided",
           "replicated_all_reduce_strided_identical_inputs", "replicated_all_reduce_strided_identical_grad_inputs",
           "replicated_all_reduce_strided_graph"]


def replicated_all_gather_strided(t: Tensor, group: ReplicaGrouping | None = None) -> Tensor:
    """The group's ``t`` flattened and concatenated (``(group_size * t.nelms,)``), reshaped to
    ``t.meta_shape`` when it has one (the gather of RTS shards)."""
    flat = t.reshape((t.nelms,)) if t.rank != 1 else t
    out = collectives.replicated_all_gather(flat, axis=0, group=group, output_shape="concat")
    if not t.meta_shape:
        return out
    whole = math.prod(t.meta_shape)
    return (out[:whole] if whole < out.shape[0] else out).reshape(t.meta_shape)


def replicated_reduce_scatter_strided(t: Tensor, op: CollectiveOps = "add", group: ReplicaGrouping | None = None,
                                      configure_output_for_replicated_tensor_sharding: bool = False) -> Tensor:
    """Member ``i``'s 1-D slice of the reduction of the group's flattened ``t`` (see
    ``ops.collectives.replicated_reduce_scatter``)."""
    return collectives.replicated_reduce_scatter(t, op, group, configure_output_for_replicated_tensor_sharding)


def replicated_all_reduce_strided(t: Tensor, op: CollectiveOps = "add", group: ReplicaGrouping | None = None) -> Tensor:
    """An all-reduce over ``group`` whose gradient is an all-reduce."""
    return all_reduce_tp(t, op, group)


def replicated_all_reduce_strided_identical_inputs(t: Tensor, op: CollectiveOps = "add",
                                                   group: ReplicaGrouping | None = None) -> Tensor:
    """``replicated_all_reduce_identical_inputs``: an identity whose gradient is an all-reduce."""
    return all_reduce_tp(t, op, group, identical_inputs=True)


def replicated_all_reduce_strided_identical_grad_inputs(t: Tensor, op: CollectiveOps = "add",
                                                        group: ReplicaGrouping | None = None) -> Tensor:
    """``replicated_all_reduce_identical_grad_inputs``: an all-reduce whose gradient is an identity."""
    return all_reduce_tp(t, op, group, identical_grad_inputs=True)


def replicated_all_reduce_strided_graph(tensors: NamedTensors, op: CollectiveOps = "add",
                                        group: ReplicaGrouping | None = None,
                                        use_io_tiles: bool = False) -> tuple[GraphWithNamedArgs, list[str]]:
    """A graph with one input per tensor of ``tensors`` that returns each all-reduced over
    ``group``; also the names of its outputs, in order.

    Example:
        >>> graph, names = replicated_all_reduce_strided_graph(grads)
        >>> reduced = NamedTensors.pack(names, graph.bind(grads).call())
    """
    ir = context.gcg().ir
    graph = ir.create_empty_graph("replica_reduce")
    names, args = [], {}
    with graph, (placement.io_tiles() if use_io_tiles else nullcontext()):
        for name, tensor in zip(*tensors.unpack()):
            sg_t = graph_input(tensor.shape, tensor.dtype, tensor.name, meta_shape=tensor.meta_shape or None)
            args[name] = sg_t
            names.append(name)
            if use_io_tiles:
                sg_t = io_tile_copy(sg_t)
            graph_output(replicated_all_reduce_strided(sg_t, op, group))
    return GraphWithNamedArgs(graph, NamedTensors.from_dict(args)), names
