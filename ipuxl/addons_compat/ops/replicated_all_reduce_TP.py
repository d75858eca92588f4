"""popxl.addons' tensor-parallel all-reduce (``popxl_addons.ops.replicated_all_reduce_TP``).

Tensor parallelism shards a layer's weights over the replicas of a group (each holds
``1/tp`` of the columns or rows); these all-reduces join the shards' work, with the
gradient rule each position in a layer needs (see ``ipuxl.kernels.tp_collectives``):

- ``replicated_all_reduce_identical_inputs(x)``: at the entry of a sharded block,
  where every member holds the same ``x``. Forward: identity; gradient: all-reduce
  (each shard's partial gradient of ``x`` is summed).
- ``replicated_all_reduce_identical_grad_inputs(z)``: at the exit, summing the shards'
  partial outputs. Forward: all-reduce; gradient: identity (the output gradient is
  the same on every member).
- ``replicated_all_reduce(t)``: all-reduce with an all-reduce gradient.

As upstream, ops with identical inputs (the first form, and the gradient of the
second) must be replaced by identities with ``popxl_addons.patterns.
apply_pre_alias_patterns(ir)`` after ``autodiff``; a Session refuses a program that
still holds one. Only ``op="add"`` is implemented, as upstream.
"""
from __future__ import annotations

from ipuxl.errors import UnsupportedError
from ipuxl.ir import context
from ipuxl.ir.build import emit
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import tp_collectives
from ipuxl.ops.collectives import CollectiveOps, check_group

__all__ = ["replicated_all_reduce_identical_inputs", "replicated_all_reduce_identical_grad_inputs",
           "replicated_all_reduce", "all_reduce_tp"]


def replicated_all_reduce_identical_inputs(t: Tensor, op: CollectiveOps = "add",
                                           group: ReplicaGrouping | None = None) -> Tensor:
    """All-reduce of a tensor every member of ``group`` holds identically: an identity whose
    gradient is an all-reduce. Run ``apply_pre_alias_patterns`` after autodiff.

    Args:
        t: the tensor (the same on every member of the group).
        op: the reduction; only ``"add"``.
        group: the replicas to reduce across (default: all).
    """
    return all_reduce_tp(t, op, group, identical_inputs=True)


def replicated_all_reduce_identical_grad_inputs(t: Tensor, op: CollectiveOps = "add",
                                                group: ReplicaGrouping | None = None) -> Tensor:
    """All-reduce whose gradient inputs are identical on every member: an all-reduce whose
    gradient is an identity. Run ``apply_pre_alias_patterns`` after autodiff.

    Args:
        t: the tensor to reduce.
        op: the reduction; only ``"add"``.
        group: the replicas to reduce across (default: all).
    """
    return all_reduce_tp(t, op, group, identical_grad_inputs=True)


def replicated_all_reduce(t: Tensor, op: CollectiveOps = "add", group: ReplicaGrouping | None = None) -> Tensor:
    """A differentiable all-reduce: its gradient is an all-reduce of the output gradient.

    Args:
        t: the tensor to reduce.
        op: the reduction; only ``"add"``.
        group: the replicas to reduce across (default: all).
    """
    return all_reduce_tp(t, op, group)


def all_reduce_tp(t: Tensor, op: CollectiveOps, group: ReplicaGrouping | None, identical_inputs: bool = False,
                  identical_grad_inputs: bool = False) -> Tensor:
    """The TP all-reduce op with both flags (the functions above, and the strided collectives)."""
    g = check_group("replicated_all_reduce_TP", t, op, group)
    if op != "add":
        raise UnsupportedError(f"replicated_all_reduce_TP of '{t.name}': op {op!r} is not implemented; "
                               "CollectiveOperator::Add is the only one, as in popxl.addons",
                               where=context.user_source_line(), fix="use op='add'")
    suffix = "_identical_inputs" if identical_inputs else "_identical_grad_inputs" if identical_grad_inputs else ""
    return emit("replicated_all_reduce_TP", tp_collectives.all_reduce_tp,
                (t, op, g.stride, g.group_size, identical_inputs, identical_grad_inputs),
                meta_fn=lambda x, *_: x.new_empty(x.shape), name=f"{t.name}_all_reduced_TP{suffix}")
