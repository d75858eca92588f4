"""Re-assembling the batches a torch loader produces into the batches one model run takes.

* ``rebatch`` (``DataLoaderMode.AsyncRebatched``, ``AsynchronousDataAccessor``'s
  ``rebatched_size``): concatenate and split batches into batches of a fixed number of
  samples.
* ``combine`` (a ``DataLoader`` with a custom ``batch_sampler``): concatenate each run of
  ``count`` consecutive batches, as PopTorch does: the batch sampler's batches are
  micro-batches, and one model run takes ``deviceIterations x replicationFactor x
  gradientAccumulation`` of them.

Batches are trees (tensor, tuple, list, dict, a type with an ``ICustomArgParser``) of
tensors whose leading dimension is the sample axis.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree

from ipuxl.errors import InvalidArgumentError
from ipuxl.poptorch_compat.custom_args import register_subclasses

__all__ = ["rebatch", "combine"]


def _type_name(value: object) -> str:
    return type(value).__name__


def rebatch(source: Iterator[Any], size: int, drop_last: bool) -> Iterator[Any]:
    """Concatenate / split the batches of ``source`` into batches of ``size`` samples.

    Every batch must have the same structure (tensor, tuple, list, dict, a type
    with an ``ICustomArgParser``...) of tensors with the same leading (sample) dimension. The leftover samples are a
    final smaller batch unless ``drop_last``.
    """
    spec: pytree.TreeSpec | None = None
    pending: list[list[torch.Tensor]] = []  # per chunk, its leaves
    pending_rows = 0

    def merge() -> list[torch.Tensor]:
        if len(pending) == 1:
            return pending[0]
        return [torch.cat(parts) for parts in zip(*pending)]

    for batch in source:
        leaves, spec = _flatten(batch, spec, "DataLoaderMode.AsyncRebatched")
        rows = _batch_rows(leaves, "DataLoaderMode.AsyncRebatched")
        pending.append(leaves)
        pending_rows += rows
        while pending_rows >= size:
            merged = merge()
            yield pytree.tree_unflatten([leaf[:size] for leaf in merged], spec)
            pending_rows -= size
            pending = [[leaf[size:] for leaf in merged]] if pending_rows else []
    if pending_rows and not drop_last:
        assert spec is not None
        yield pytree.tree_unflatten(merge(), spec)


def _flatten(batch: Any, spec: pytree.TreeSpec | None, who: str) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves of ``batch`` and its structure, which must be ``spec`` (the first batch's) when given."""
    register_subclasses(batch)
    leaves, batch_spec = pytree.tree_flatten(batch)
    if spec is not None and batch_spec != spec:
        raise InvalidArgumentError(f"{who}: batches changed structure between two reads",
                                   fix="make every batch (the dataset's samples, collate_fn's result) have the "
                                       "same structure")
    return leaves, batch_spec


def _batch_rows(leaves: list[Any], who: str) -> int:
    if not leaves or not all(isinstance(leaf, torch.Tensor) and leaf.dim() > 0 for leaf in leaves):
        raise InvalidArgumentError(
            f"{who} needs batches made of tensors with a batch dimension, got "
            f"{[_type_name(leaf) for leaf in leaves]}",
            fix="return tensors (or tuples / dicts of tensors) from the dataset, or use DataLoaderMode.Async")
    rows = {leaf.shape[0] for leaf in leaves}
    if len(rows) != 1:
        raise InvalidArgumentError(
            f"{who}: the tensors of one batch have different batch sizes {sorted(rows)}",
            fix="make every tensor of a batch have the same leading dimension")
    return rows.pop()


def combine(source: Iterator[Any], count: int, drop_last: bool) -> Iterator[Any]:
    """Each ``count`` consecutive batches of ``source`` concatenated along the sample axis
    (the batches may differ in size); a final shorter run is one batch unless ``drop_last``."""
    spec: pytree.TreeSpec | None = None
    pending: list[list[torch.Tensor]] = []
    for batch in source:
        leaves, spec = _flatten(batch, spec, "a DataLoader with a batch_sampler")
        _batch_rows(leaves, "a DataLoader with a batch_sampler")
        pending.append(leaves)
        if len(pending) == count:
            yield pytree.tree_unflatten([torch.cat(parts) for parts in zip(*pending)], spec)
            pending = []
    if pending and not drop_last:
        assert spec is not None
        yield pytree.tree_unflatten([torch.cat(parts) for parts in zip(*pending)], spec)
