"""popxl.addons' ``cross_entropy_sharded_wr_loss``: cross entropy of logits sharded over the
class axis between the IPUs of one replica ("within replica", tensor model parallelism
inside a replica; ``cross_entropy_sharded_loss`` is its across-replicas sibling)."""
from __future__ import annotations

from typing import Iterable

from ipuxl.errors import InvalidValueError, ShapeMismatchError
from ipuxl.ir import context, placement
from ipuxl.ir.build import emit
from ipuxl.ir.graph import describe
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels.sharded_loss import cross_entropy_of_shards

__all__ = ["cross_entropy_sharded_wr_loss"]


def _ipus_of(ts: list[Tensor], ipus: Iterable[int] | None) -> list[int]:
    """The IPU of each tensor: ``ipus`` when given, else where each lives (upstream's ``handle_ipus``)."""
    if ipus is None:
        found = [placement.ipu_of(t.node) for t in ts]
        if any(i is None for i in found):
            raise InvalidValueError("Could not automatically infer the IPU of all input Tensors. Please specify "
                                    "the IPUs via the `ipus` parameter.", where=context.user_source_line(),
                                    fix="pass ipus=[...], one IPU per logits shard")
        return [int(i) for i in found if i is not None]
    listed = list(ipus)
    if len(ts) != len(listed):
        raise InvalidValueError(f"Number of specified tensor does not equal number of specified IPUs. "
                                f"{len(ts)} != {len(listed)}", where=context.user_source_line(),
                                fix="give one IPU per logits shard")
    return listed


def cross_entropy_sharded_wr_loss(logits: list[Tensor], indices: list[Tensor],
                                  ipus: Iterable[int] | None = None) -> Tensor:
    """Per-sample cross entropy of ``logits`` split over the class axis between IPUs.

    Args:
        logits: one ``(n_samples, classes of the shard)`` tensor per IPU, in class order
            (shards may differ by one class when the vocabulary does not divide evenly).
        indices: ``(n_samples,)`` global class indices, one copy per IPU (the op offsets
            them to each shard itself).
        ipus: the IPU of each shard (default: where each logits tensor lives).

    Returns:
        The unreduced loss ``(n_samples,)``, on the first shard's IPU.

    Raises:
        InvalidValueError: (a ValueError, as upstream) as many logits as indices not given,
            IPUs that cannot be inferred, or logits and indices on different IPUs.
        ShapeMismatchError: a shard not 2-D, shards with different sample counts, or indices
            not ``(n_samples,)``.
    """
    logits, indices = list(logits), list(indices)
    if len(logits) != len(indices):
        raise InvalidValueError("You must provide the same number of logits and indices.",
                                where=context.user_source_line(), fix="give one indices tensor per logits shard")
    shard_ipus = _ipus_of(logits, ipus)
    index_ipus = _ipus_of(indices, shard_ipus if ipus is not None else None)
    if shard_ipus != index_ipus:
        raise InvalidValueError("The logits and indices IPUs do not match.", where=context.user_source_line(),
                                fix="copy the indices to each shard's IPU (t.copy_to_ipu(...))")
    samples = logits[0].shape[:1]
    if any(t.rank != 2 or t.shape[:1] != samples for t in logits) or any(t.shape != samples for t in indices):
        raise ShapeMismatchError("cross_entropy_sharded_wr_loss: needs logits (n_samples, classes of the shard) "
                                 f"and indices (n_samples,), got {[describe(t) for t in logits]} and "
                                 f"{[describe(t) for t in indices]}", where=context.user_source_line(),
                                 fix="flatten the sample axes first")
    with placement.ipu(shard_ipus[0]), placement.unchecked():  # one op over every shard's IPU, as upstream's
        return emit("cross_entropy_sharded", cross_entropy_of_shards, (len(logits), *logits, indices[0]),
                    meta_fn=lambda n, first, *_: first.new_empty(first.shape[:1]), name="cross_entropy_sharded_out")
