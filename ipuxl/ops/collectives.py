"""Collectives across replicas (PopXL's ``ops.collectives``).

Each op combines one tensor from every replica of a group (default: all replicas
of the ``Ir``). ``op`` is one of ``add``, ``mean``, ``mul``, ``min``, ``max``,
``and``, ``or``, ``square_add``. With ``Ir(replication=1)`` they act on the one
replica (an all-reduce returns a copy). The session runs them exactly, in replica
order (the kernels are in ``ipuxl.kernels.collectives``; the device runs the replicas,
see ``ipuxl.device.replicas``).

``all_reduce`` (and its identical-inputs forms) reduces instead across the IPUs of one
replica: one tensor per IPU in, one result per IPU out.
"""
from __future__ import annotations

from typing import Any, Literal, Sequence

import torch

from ipuxl.ir.build import emit
from ipuxl.errors import (
    InvalidArgumentError, InvalidValueError, PlacementError, ReplicationError, ShapeMismatchError, UndefinedValue,
)
from ipuxl.ir import context, placement
from ipuxl.ir.graph import describe
from ipuxl.ir.meta import IPU, META_SHAPE
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import collectives as kernels
from ipuxl.kernels import remote as remote_kernels
from ipuxl.ops import shape as shape_ops

__all__ = ["replicated_all_reduce", "replicated_all_reduce_", "replicated_reduce_scatter",
           "replicated_all_gather", "CollectiveOps", "replica_sharded_slice", "replicated_slice", "check_group",
           "all_reduce", "all_reduce_identical_inputs", "all_reduce_identical_grad_inputs"]

CollectiveOps = Literal["add", "mean", "mul", "min", "max", "and", "or", "square_add"]


def _check(op_name: str, t: Tensor, op: str | None, group: ReplicaGrouping | None) -> ReplicaGrouping:
    if not isinstance(t, Tensor):
        raise InvalidArgumentError(f"{op_name} needs a Tensor, got {describe(t)}", where=context.user_source_line(),
                                   fix="pass a tensor of the current graph")
    if op is not None and op not in kernels.REDUCTIONS:
        raise InvalidArgumentError(f"{op_name}: unknown reduction op {op!r}", where=context.user_source_line(),
                                   fix=f"use one of {sorted(kernels.REDUCTIONS)}")
    ir = context.gcg().ir
    if group is None:
        return ir.replica_grouping()
    if not isinstance(group, ReplicaGrouping):
        raise InvalidArgumentError(f"{op_name}: group must be a ReplicaGrouping, got {type(group).__name__}",
                                   where=context.user_source_line(),
                                   fix="make one with ir.replica_grouping(stride, group_size)")
    if group.replication_factor != ir.replication_factor:
        raise ReplicationError(
            f"{op_name} of '{t.name}': {group} is for {group.replication_factor} replicas but the Ir has "
            f"replication factor {ir.replication_factor}", where=context.user_source_line(),
            fix="create the group with this Ir's ir.replica_grouping(stride, group_size); stride x group_size "
                "must divide the replication factor")
    return group


def check_group(op_name: str, t: Tensor, op: str | None, group: ReplicaGrouping | None) -> ReplicaGrouping:
    """The grouping a collective ``op_name`` of ``t`` runs over (default: all replicas), checked
    as the collectives here check theirs; for ops built on them elsewhere (popxl.addons')."""
    return _check(op_name, t, op, group)


def _axis_and_group(op_name: str, axis: Any, group: ReplicaGrouping | None) -> tuple[int, ReplicaGrouping | None]:
    """A ``ReplicaGrouping`` in the axis place is the group (PopXL 3.0-3.2's ``(t, group)``
    signature of ``replicated_all_gather``); any other axis must be an int."""
    if isinstance(axis, ReplicaGrouping):
        if group is not None:
            raise InvalidArgumentError(f"{op_name}: two replica groupings given (as axis and as group)",
                                       where=context.user_source_line(), fix="pass the grouping once, as group=")
        return 0, axis
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise InvalidArgumentError(f"{op_name}: axis must be an int, got {type(axis).__name__}",
                                   where=context.user_source_line(),
                                   fix="pass the axis as an int and the grouping as group=")
    return axis, group


def replicated_all_reduce(t: Tensor, op: CollectiveOps = "add", group: ReplicaGrouping | None = None) -> Tensor:
    """Reduce ``t`` over the replicas of each group; every member gets the result."""
    g = _check("replicated_all_reduce", t, op, group)
    return emit("replicated_all_reduce", kernels.all_reduce, (t, op, g.stride, g.group_size),
                meta_fn=lambda x, *_: torch.empty_like(x), name=f"{t.name}_all_reduced")


def replicated_all_reduce_(t: Tensor, op: CollectiveOps = "add", group: ReplicaGrouping | None = None) -> Tensor:
    """In-place ``replicated_all_reduce``: writes the result into ``t`` and returns it."""
    g = _check("replicated_all_reduce_", t, op, group)
    return emit("replicated_all_reduce_", kernels.all_reduce_, (t, op, g.stride, g.group_size),
                meta_fn=lambda x, *_: x, modifies=t, name=f"{t.name}_all_reduced")


def replicated_reduce_scatter(t: Tensor, op: CollectiveOps = "add", group: ReplicaGrouping | None = None,
                              configure_output_for_replicated_tensor_sharding: bool = False) -> Tensor:
    """Reduce ``t`` (flattened) over each group; member ``i`` gets the ``i``-th of
    ``group_size`` equal 1-D slices (zero padded to a multiple of the group size).

    With ``configure_output_for_replicated_tensor_sharding`` the result records
    ``t``'s shape as its meta shape, so ``replicated_all_gather`` restores it.
    """
    g = _check("replicated_reduce_scatter", t, op, group)
    shard = -(-t.nelms // g.group_size)
    out = emit("replicated_reduce_scatter", kernels.reduce_scatter, (t, op, g.stride, g.group_size),
               meta_fn=lambda x, *_: torch.empty((shard,), dtype=x.dtype, device="meta"),
               name=f"{t.name}_reduce_scattered")
    if configure_output_for_replicated_tensor_sharding:
        out.node.meta[META_SHAPE] = tuple(t.shape)
    return out


def replicated_all_gather(t: Tensor, axis: int = 0, group: ReplicaGrouping | None = None,
                          output_shape: Literal["new_axis", "concat", "meta_shape", "auto"] = "auto") -> Tensor:
    """Gather ``t`` from every member of its group.

    ``output_shape``: ``new_axis`` gives ``(group_size, *t.shape)``; ``concat``
    concatenates along ``axis``; ``meta_shape`` restores the shape recorded by a
    sharding reduce-scatter; ``auto`` is ``meta_shape`` when ``t`` has one, else ``concat``.

    As in PopXL 3.0-3.2, a ``ReplicaGrouping`` in second place is the group (their signature
    was ``(t, group)``), so programs written for either signature run.

    Differentiable, as in PopXL: ``transforms.autodiff`` turns it into a replicated slice, each
    replica taking its own input's part (its shard, for ``meta_shape``) of its own output
    gradient. It is not summed over the replicas: where their gradients differ and the sum is
    wanted, reduce-scatter the full gradient (``replicated_reduce_scatter``), as popxl.addons does.
    """
    axis, group = _axis_and_group("replicated_all_gather", axis, group)
    g = _check("replicated_all_gather", t, None, group)
    meta_shape = tuple(t.node.meta.get(META_SHAPE, ()))
    mode = output_shape if output_shape != "auto" else ("meta_shape" if meta_shape else "concat")
    if mode not in ("new_axis", "concat", "meta_shape"):
        raise InvalidArgumentError(f"replicated_all_gather: unknown output_shape {output_shape!r}",
                                   where=context.user_source_line(),
                                   fix="use 'new_axis', 'concat', 'meta_shape' or 'auto'")
    if mode == "meta_shape" and not meta_shape:
        raise InvalidArgumentError(f"replicated_all_gather: '{t.name}' has no meta shape",
                                   where=context.user_source_line(),
                                   fix="use output_shape='new_axis' or 'concat', or gather the output of "
                                       "replicated_reduce_scatter(..., configure_output_for_replicated_tensor_"
                                       "sharding=True)")
    if mode == "concat" and not -t.rank <= axis < max(t.rank, 1):
        raise InvalidArgumentError(f"replicated_all_gather: axis {axis} is out of range for {describe(t)}",
                                   where=context.user_source_line(), fix=f"use an axis in [{-t.rank}, {t.rank})")

    def meta(x: torch.Tensor, *_: object) -> torch.Tensor:
        if mode == "new_axis":
            return torch.empty((g.group_size, *x.shape), dtype=x.dtype, device="meta")
        if mode == "meta_shape":
            return torch.empty(meta_shape, dtype=x.dtype, device="meta")
        if x.dim() == 0:
            return torch.empty((g.group_size,), dtype=x.dtype, device="meta")
        return torch.cat([x] * g.group_size, dim=axis)

    return emit("replicated_all_gather", kernels.differentiable_all_gather,
                (t, axis, mode, g.stride, g.group_size, meta_shape),
                meta_fn=meta, name=f"{t.name}_all_gathered")


# -- replicated tensor sharding ----------------------------------------------------------------------
# Both slices take this replica's part of a tensor every replica of the group holds, with no
# communication, in the layouts of ``ipuxl.ir.remote``: a sharded slice is member i's 1-D shard
# of the flattened tensor, zero padded to a multiple of the group size, so
# ``replicated_all_gather`` (output_shape "auto") restores the full tensor from the recorded
# meta shape. As in PopXL both are differentiable: the gradient is an all-gather over the group.
def replica_sharded_slice(t: Tensor, group: ReplicaGrouping | None = None) -> Tensor:
    """This replica's shard of ``t``: ``(ceil(t.nelms / group_size),)``, ``meta_shape`` ``t.shape``.

    Args:
        t: a tensor every member of the group holds (the same value, for RTS).
        group: the replicas ``t`` is sharded over (default: all).

    Example:
        >>> shard = ops.collectives.replica_sharded_slice(w, group=ir.replica_grouping())
        >>> full = ops.collectives.replicated_all_gather(shard, group=ir.replica_grouping())
    """
    g = _check("replica_sharded_slice", t, None, group)
    size = -(-t.nelms // g.group_size)
    out: Tensor = emit("replica_sharded_slice", remote_kernels.replica_sharded_slice, (t, g.stride, g.group_size),
                       meta_fn=lambda x, *_: torch.empty((size,), dtype=x.dtype, device="meta"),
                       name=f"{t.name}_sharded")
    out.node.meta[META_SHAPE] = tuple(t.shape)
    return out


def replicated_slice(t: Tensor, axis: int = 0, group: ReplicaGrouping | None = None) -> Tensor:
    """This replica's ``1 / group_size`` part of ``t`` along ``axis`` (member ``i`` gets the ``i``-th).

    Where the part is one row (``t.shape[axis] == group_size``) the axis is dropped, as in PopXL.

    Raises:
        ShapeMismatchError: ``t.shape[axis]`` is not a multiple of the group size.
    """
    axis, group = _axis_and_group("replicated_slice", axis, group)
    g = _check("replicated_slice", t, None, group)
    if not -t.rank <= axis < t.rank:
        raise InvalidArgumentError(f"replicated_slice: axis {axis} is out of range for {describe(t)}",
                                   where=context.user_source_line(), fix=f"use an axis in [{-t.rank}, {t.rank})")
    axis %= t.rank
    if t.shape[axis] % g.group_size:
        raise ShapeMismatchError(
            f"replicated_slice: axis {axis} of {describe(t)} has size {t.shape[axis]}, not a multiple of the "
            f"group size {g.group_size}", where=context.user_source_line(),
            fix="slice along an axis whose size the group size divides, or use replica_sharded_slice (pads)")
    shape = list(t.shape)
    shape[axis] //= g.group_size
    out: Tensor = emit("replicated_slice", remote_kernels.replicated_slice, (t, axis, g.stride, g.group_size),
                       meta_fn=lambda x, *_: torch.empty(shape, dtype=x.dtype, device="meta"),
                       name=f"{t.name}_sliced")
    if shape[axis] != 1:
        return out
    # As PopXL: where each member gets one row the axis is dropped, and for axis > 0 the remaining
    # axes come back in the order of PopXL's rearrangement (its first remaining axis moved to ``axis``)
    out = shape_ops.reshape(out, [d for i, d in enumerate(shape) if i != axis])
    order = list(range(1, out.rank))
    order.insert(min(axis, len(order)), 0)
    return out if axis == 0 or order == sorted(order) else shape_ops.transpose(out, order)


# -- across the IPUs of one replica ------------------------------------------------------------------
def all_reduce(ts: Sequence[Tensor], ipus: Sequence[int] | None = None, op: CollectiveOps = "add") -> list[Tensor]:
    """Reduce the tensors ``ts``, one per IPU, across the IPUs of a replica (PopXL's).

    Output ``i`` lives on IPU ``ipus[i]`` and holds the reduction of all of ``ts`` (in
    IPU order). Only ``op="add"`` has a gradient (the sum of the output gradients, for
    every input), as in PopXL.

    Args:
        ts: the tensors to reduce, of one shape and dtype.
        ipus: the IPU of each tensor; by default each tensor's ``ipu``.
        op: ``add``, ``mean``, ``mul``, ``min``, ``max``, ``and``, ``or`` or ``square_add``.

    Raises:
        PlacementError: (a ValueError, as PopXL's) ``ipus`` not given and a tensor's IPU
            is undefined (a graph input, a variable built outside every ``ipu(n)``).
        InvalidValueError: (a ValueError) an unknown ``op``, or ``ts`` and ``ipus`` of
            different lengths.
        ShapeMismatchError: the tensors differ in shape or dtype.

    Example:
        >>> with popxl.ipu(0):
        ...     a = x0 * 2
        >>> with popxl.ipu(1):
        ...     b = x1 * 3
        >>> a_sum, b_sum = ops.collectives.all_reduce([a, b])   # a_sum on IPU 0, b_sum on IPU 1
    """
    return _all_reduce_ipus("all_reduce", ts, ipus, op, "all_reduce")


def all_reduce_identical_inputs(ts: Sequence[Tensor], ipus: Sequence[int] | None = None,
                                op: CollectiveOps = "add") -> list[Tensor]:
    """``all_reduce`` of tensors known to be identical: the forward is the identity (each
    output is its input), the gradient an all-reduce (add) of the output gradients, as PopXL's."""
    return _all_reduce_ipus("all_reduce_identical_inputs", ts, ipus, op, "identical_inputs")


def all_reduce_identical_grad_inputs(ts: Sequence[Tensor], ipus: Sequence[int] | None = None,
                                     op: CollectiveOps = "add") -> list[Tensor]:
    """``all_reduce`` whose output gradients are known to be identical: the forward is an
    all-reduce, the gradient the identity (each input gets its output's), as PopXL's."""
    return _all_reduce_ipus("all_reduce_identical_grad_inputs", ts, ipus, op, "identical_grad_inputs")


def _all_reduce_ipus(op_name: str, ts: Sequence[Tensor], ipus: Sequence[int] | None, op: str,
                     mode: str) -> list[Tensor]:
    if op not in kernels.REDUCTIONS:
        raise InvalidValueError(f"{op_name}: Not a valid op: {op}. Must choose from: {', '.join(kernels.REDUCTIONS)}",
                                where=context.user_source_line(), fix="pass one of the ops listed")
    ts = list(ts)
    for t in ts:
        if not isinstance(t, Tensor):
            raise InvalidArgumentError(f"{op_name} needs a list of Tensors, got {describe(t)} in it",
                                       where=context.user_source_line(), fix="pass tensors of the current graph")
    if not ts:
        raise InvalidValueError(f"{op_name}: no tensors to reduce", where=context.user_source_line(),
                                fix="pass one tensor per IPU")
    ipus = _ipus_of(op_name, ts) if ipus is None else list(ipus)
    if len(ts) != len(ipus):
        raise InvalidValueError(f"{op_name}: Number of specified tensor does not equal number of specified IPUs. "
                                f"{len(ts)} != {len(ipus)}", where=context.user_source_line(),
                                fix="give one IPU per tensor")
    specs = {(t.shape, t.spec.dtype) for t in ts}
    if len(specs) > 1:
        raise ShapeMismatchError(f"{op_name}: the tensors differ in shape or dtype: "
                                 f"{', '.join(describe(t) for t in ts)}", where=context.user_source_line(),
                                 fix="reduce tensors of one shape and dtype")
    with placement.unchecked():  # reads one tensor of each IPU, as PopXL's op
        outs = emit(op_name, kernels.all_reduce_ipus, (ts, op, mode), num_outputs=len(ts),
                    meta_fn=lambda xs, *_: tuple(torch.empty_like(x) for x in xs), name="all_reduce_out")
    for out, ipu in zip(outs, ipus):
        out.node.meta[IPU] = ipu
    return list(outs)


def _ipus_of(op_name: str, ts: list[Tensor]) -> list[int]:
    try:
        return [t.ipu for t in ts]
    except UndefinedValue as error:
        raise PlacementError(f"{op_name}: Could not automatically infer the IPU of all input Tensors `ts`. Please "
                             "specify the IPUs via the `ipus` parameter.", where=context.user_source_line(),
                             fix="pass ipus=[...], one IPU per tensor") from error
