"""popxl.addons' ``Embedding``: rows of a table gathered by index, optionally sharded
over the vocabulary axis (tensor parallelism)."""
from __future__ import annotations

from functools import partial
from math import ceil

import numpy as np

from ipuxl import ops
from ipuxl.addons_compat.layers.init import truncated_normal
from ipuxl.addons_compat.module import Module
from ipuxl.dtypes import DTypeLike
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor

__all__ = ["Embedding", "MULTISLICE_MAGIC_NUMBER"]

#: Shard sizes are rounded up to a multiple of this (Poplar's slicing prefers multiples of 16).
MULTISLICE_MAGIC_NUMBER = 16


class Embedding(Module):
    """A ``(vocab_size, hidden_size)`` table (or its shard) whose rows are gathered by index.

    Args:
        dtype: the table's dtype.
        vocab_size: the number of rows (indices range over ``[0, vocab_size)``).
        hidden_size: the size of each row.
        axis: the vocabulary axis of the table (0: rows).
        replica_grouping: with G > 1 groups the table is sharded over the vocabulary:
            group ``i`` holds rows ``[i * shard, (i + 1) * shard)`` with
            ``shard = get_vocab_shard_size(vocab_size, G)`` (the last shard zero padded).
            Indices must then be offset per shard (``get_offsets``); out-of-range
            indices give zero rows, so summing the shards' outputs over the group
            (``replicated_all_reduce_identical_grad_inputs``) gives the lookup.
        cache: reuse graphs where possible.
    """

    def __init__(self, dtype: DTypeLike, vocab_size: int, hidden_size: int, axis: int = 0,
                 replica_grouping: ReplicaGrouping | None = None, cache: bool = False):
        super().__init__(cache=cache)
        self.dtype, self.vocab_size, self.hidden_size, self.axis = dtype, vocab_size, hidden_size, axis
        self.replica_grouping = replica_grouping
        self.n_shards = replica_grouping.num_groups if replica_grouping else 1
        self.vocab_shard_size = self.get_vocab_shard_size(vocab_size, self.n_shards)
        self.offsets = self.get_offsets(vocab_size, self.n_shards)

    @staticmethod
    def get_vocab_shard_size(vocab_size: int, n_shards: int) -> int:
        """Rows per shard: ``ceil(vocab_size / n_shards)`` rounded up to a multiple of 16
        (``vocab_size`` itself rounded so when not sharded)."""
        shard_size = ceil(vocab_size / n_shards)
        return MULTISLICE_MAGIC_NUMBER * ceil(shard_size / MULTISLICE_MAGIC_NUMBER)

    @staticmethod
    def get_offsets(vocab_size: int, n_shards: int) -> np.ndarray:
        """The first vocabulary index of each shard: ``[0, shard, 2 * shard, ...]``."""
        shard_size = Embedding.get_vocab_shard_size(vocab_size, n_shards)
        return np.arange(n_shards * shard_size, step=shard_size)

    def build(self, indices: Tensor) -> Tensor:
        """The rows of ``indices`` (pre-offset per shard when sharded): ``(*indices.shape, hidden_size)``."""
        self.weight = self.add_variable_input(
            "weight", partial(truncated_normal, (self.vocab_shard_size, self.hidden_size)), self.dtype,
            replica_grouping=self.replica_grouping)
        return ops.gather(self.weight, indices, axis=self.axis, zero_OOR=self.n_shards > 1)
