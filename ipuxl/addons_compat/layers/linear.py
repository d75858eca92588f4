"""popxl.addons' ``Linear``: ``x @ weight + bias``, optionally sharded over replica groups."""
from __future__ import annotations

from functools import partial
import numpy as np
import torch

from ipuxl.addons_compat.layers.init import truncated_normal
from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.utils import WeightsDict
from ipuxl.dtypes import DTypeLike, float32
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor
from ipuxl.utils import to_numpy

__all__ = ["Linear"]


class Linear(Module):
    """``x @ weight + bias`` with ``weight`` of shape ``(in, out_features)``.

    Args:
        out_features: the output size (of this shard, when sharded).
        bias: add a ``bias`` of shape ``(out_features,)``.
        replica_grouping: the grouping of the variables: with G > 1 groups each group
            holds its own weight and bias (tensor parallelism: one shard per group).
        cache: reuse graphs where possible.
    """

    def __init__(self, out_features: int, bias: bool = True, replica_grouping: ReplicaGrouping | None = None,
                 cache: bool = False):
        super().__init__(cache=cache)
        self.out_features = out_features
        self.bias = bias
        self.replica_grouping = replica_grouping

    def build(self, x: Tensor) -> Tensor:
        w = self.add_variable_input("weight", partial(truncated_normal, (x.shape[-1], self.out_features)), x.dtype,
                                    replica_grouping=self.replica_grouping)
        y = x @ w
        if self.bias:
            b = self.add_variable_input("bias", partial(np.zeros, y.shape[-1]), x.dtype,
                                        replica_grouping=self.replica_grouping)
            y = y + b
        return y

    @staticmethod
    def torch_mapping(variables: NamedTensors, nn_layer: torch.nn.Linear, dtype: DTypeLike = float32) -> WeightsDict:
        """The values of ``variables`` (this layer's) taken from a ``torch.nn.Linear``."""
        state = {variables.weight: to_numpy(nn_layer.weight.data, dtype).T}
        if "bias" in variables.keys():
            state[variables.bias] = to_numpy(nn_layer.bias.data, dtype)
        return WeightsDict(state)
