"""popxl.addons' ``LinearGQ``: a linear layer whose weight is stored 4-bit group-quantised."""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.ops.group_quantize_decompress import group_quantize_compress_numpy, group_quantize_decompress
from ipuxl.addons_compat.utils import WeightsDict
from ipuxl.dtypes import DTypeLike, float32, uint16
from ipuxl.errors import InvalidValueError
from ipuxl.ir import context
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor
from ipuxl.utils import to_numpy

__all__ = ["LinearGQ"]


class LinearGQ(Module):
    """``x @ decompress(weight) + bias``: the weight held as three variables,
    ``weight_compressed`` (uint16, four 4-bit values each), ``weight_decompression_scale``
    and ``weight_decompression_bias`` (one per group of ``group_size`` values), all zero
    until written (``torch_mapping`` compresses a float weight).

    Args:
        out_features: the output size (of this shard, when sharded).
        bias: add a ``bias`` of shape ``(out_features,)``.
        replica_grouping: the grouping of the variables (G > 1 groups: one shard each).
        group_size: values per quantisation group (a multiple of 4 dividing the grouped axis).
        dim: the weight axis grouped: -1 or 1 the output axis, 0 the input axis.
    """

    def __init__(self, out_features: int, bias: bool = True, replica_grouping: ReplicaGrouping | None = None,
                 group_size: int = 0, dim: int = -1):
        super().__init__()
        self.out_features, self.bias, self.replica_grouping = out_features, bias, replica_grouping
        self.group_size, self.dim = group_size, dim

    def build(self, x: Tensor) -> Tensor:
        in_features = x.shape[-1]
        compressed, kept = (self.out_features, in_features) if self.dim in (1, -1) else (in_features, self.out_features)
        if self.group_size <= 0 or self.group_size % 4 or compressed % self.group_size:
            raise InvalidValueError(
                f"LinearGQ: group_size {self.group_size} must be a positive multiple of 4 dividing the grouped axis "
                f"({compressed})", where=context.user_source_line(), fix="pick e.g. group_size=64")
        groups = compressed // self.group_size
        rg = self.replica_grouping
        w_compressed = self.add_variable_input(
            "weight_compressed", partial(np.zeros, shape=(kept, groups, self.group_size // 4), dtype=np.uint16),
            uint16, replica_grouping=rg)
        w_scale = self.add_variable_input("weight_decompression_scale", partial(np.zeros, shape=(kept, groups, 1)),
                                          x.dtype, replica_grouping=rg)
        w_bias = self.add_variable_input("weight_decompression_bias", partial(np.zeros, shape=(kept, groups, 1)),
                                         x.dtype, replica_grouping=rg)
        y = x @ group_quantize_decompress(w_compressed, w_scale, w_bias, self.dim)
        if self.bias:
            y = y + self.add_variable_input("bias", partial(np.zeros, y.shape[-1]), x.dtype, replica_grouping=rg)
        return y

    @staticmethod
    def torch_mapping(variables: NamedTensors, nn_layer: torch.nn.Linear, dtype: DTypeLike = float32,
                      group_size: int = 64, dim: int = -1) -> WeightsDict:
        """The values of ``variables`` (this layer's): ``nn_layer``'s weight compressed, its bias."""
        packed, scale, bias = group_quantize_compress_numpy(nn_layer.weight.T.detach().numpy(), group_size, dim=dim)
        state = {variables.weight_compressed: packed, variables.weight_decompression_scale: scale,
                 variables.weight_decompression_bias: bias}
        if "bias" in variables.keys():
            state[variables.bias] = to_numpy(nn_layer.bias.data, dtype)
        return WeightsDict(state)
