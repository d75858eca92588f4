"""popxl.addons' ``cross_entropy_sharded_loss``: cross entropy of logits sharded over the
class axis (tensor-parallel language-model heads)."""
from __future__ import annotations

from typing import Literal

from ipuxl import ops
from ipuxl.errors import InvalidValueError, ShapeMismatchError
from ipuxl.ir import context
from ipuxl.ir.build import emit
from ipuxl.ir.graph import describe
from ipuxl.ir.graph_builder import constant
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import tp_collectives
from ipuxl.ops.collectives import check_group

__all__ = ["cross_entropy_sharded_loss"]

REDUCTION_TYPE = Literal["mean", "sum", "none"]


def cross_entropy_sharded_loss(logits: Tensor, indices: Tensor, ignore_index: Tensor | int | None = None,
                               replica_grouping: ReplicaGrouping | None = None, reduction: REDUCTION_TYPE = "mean",
                               available_memory_proportion: float = 0.4) -> Tensor:
    """Cross entropy of ``logits`` sharded over the class axis within ``replica_grouping``.

    Args:
        logits: ``(n_samples, classes of this shard)``: each member holds its classes.
        indices: ``(n_samples,)`` labels, the same on every member but offset to its
            shard's class range (out of range: a class of another shard).
        ignore_index: samples whose (offset) label equals it contribute nothing.
        replica_grouping: the tensor-parallel group (default: all replicas).
        reduction: ``mean`` (over the samples not ignored), ``sum`` or ``none``.
        available_memory_proportion: accepted for upstream's signature (IPU tuning).

    Returns:
        The loss, the same on every member: a scalar, or ``(n_samples,)`` for ``none``.

    Raises:
        ShapeMismatchError: logits not 2-D, or indices not ``(n_samples,)``.
        InvalidValueError: (a ValueError, as upstream) an unknown reduction.
    """
    g = check_group("cross_entropy_sharded_loss", logits, None, replica_grouping)
    if reduction not in ("mean", "sum", "none"):
        raise InvalidValueError(f"`reduction` should be one of `mean`, `sum` and `none`. Passed: {reduction}",
                                where=context.user_source_line(), fix="use 'mean', 'sum' or 'none'")
    if logits.rank != 2 or indices.shape != logits.shape[:1]:
        raise ShapeMismatchError(f"cross_entropy_sharded_loss: needs logits (n_samples, classes) and indices "
                                 f"(n_samples,), got {describe(logits)} and {describe(indices)}",
                                 where=context.user_source_line(), fix="flatten the sample axes first")
    loss = emit("cross_entropy_sharded", tp_collectives.cross_entropy_sharded,
                (logits, indices, g.stride, g.group_size),
                meta_fn=lambda x, *_: x.new_empty(x.shape[:1]), name="cross_entropy_sharded_out")
    mask = None
    if ignore_index is not None:
        if not isinstance(ignore_index, Tensor):
            ignore_index = constant(ignore_index, indices.dtype, name="ignore_index")
        mask = ops.cast(ops.logical_not(ops.equal(indices, ignore_index)), loss.dtype)
        loss = loss * mask
    if reduction == "mean":
        return ops.sum(loss) / ops.sum(mask) if mask is not None else ops.mean(loss)
    if reduction == "sum":
        return ops.sum(loss)
    return loss
