"""popxl.addons' ``GroupNorm``: group normalisation of ``(N, C, *)`` input."""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from ipuxl import ops
from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.ir.tensor import Tensor
from ipuxl.utils import to_numpy

__all__ = ["GroupNorm"]


class GroupNorm(Module):
    """Group normalisation of ``(N, C, *)`` input: channels in ``num_groups`` groups, each
    normalised over its channels and spatial axes, with learnt ``weight`` (ones) and
    ``bias`` (zeros) of shape ``(C,)``.

    Args:
        num_groups: groups the channels (axis 1) are split into.
        replica_grouping: the replica grouping of the variables.
        eps: added to the variance.
        cache: reuse graphs where possible.
    """

    def __init__(self, num_groups: int, replica_grouping: Any = None, eps: float = 1e-5, cache: bool = False):
        super().__init__(cache=cache)
        self.num_groups, self.replica_grouping, self.eps = num_groups, replica_grouping, eps

    def build(self, x: Tensor) -> Tensor:
        channels = x.shape[1]
        w = self.add_variable_input("weight", partial(np.ones, channels), x.dtype, replica_grouping=self.replica_grouping)
        b = self.add_variable_input("bias", partial(np.zeros, channels), x.dtype, replica_grouping=self.replica_grouping)
        return ops.group_norm(x, w, b, num_groups=self.num_groups, eps=self.eps)

    @staticmethod
    def torch_mapping(variables: NamedTensors, nn_layer: torch.nn.GroupNorm, dtype: Any = None) -> dict[Tensor, np.ndarray]:
        """The values of ``variables`` (this layer's) taken from a ``torch.nn.GroupNorm``."""
        return {variables.weight: to_numpy(nn_layer.weight.data, dtype or variables.weight.dtype),
                variables.bias: to_numpy(nn_layer.bias.data, dtype or variables.bias.dtype)}
