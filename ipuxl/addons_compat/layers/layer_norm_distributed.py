"""popxl.addons' ``LayerNormDistributed``: layer normalisation of a tensor sharded over its
hidden axis within a replica group."""
from __future__ import annotations

from functools import partial

import numpy as np

from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.ops.layer_norm_distributed import layer_norm_distributed
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir import context
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor

__all__ = ["LayerNormDistributed"]


class LayerNormDistributed(Module):
    """Layer normalisation of ``x`` whose hidden axis (last) is sharded over the members of
    ``replica_grouping``: the statistics are those of the whole hidden axis.

    The ``weight`` and ``bias`` shards are variables with the transposed grouping (one
    value per member position), as upstream.

    Args:
        replica_grouping: the tensor-parallel group the hidden axis is sharded over.
    """

    def __init__(self, replica_grouping: ReplicaGrouping | None = None):
        super().__init__()
        self.replica_grouping = replica_grouping

    def build(self, x: Tensor, eps: float = 1e-5) -> Tensor:
        if self.replica_grouping is None:
            raise InvalidArgumentError("LayerNormDistributed needs the replica grouping its input is sharded over",
                                       where=context.user_source_line(),
                                       fix="pass replica_grouping=ir.replica_grouping(stride=1, group_size=tp)")
        grouping = self.replica_grouping.transpose()
        w = self.add_variable_input("weight", partial(np.ones, x.shape[-1]), x.dtype, replica_grouping=grouping)
        b = self.add_variable_input("bias", partial(np.zeros, x.shape[-1]), x.dtype, replica_grouping=grouping)
        return layer_norm_distributed(x, w, b, epsilon=eps, group=self.replica_grouping)
