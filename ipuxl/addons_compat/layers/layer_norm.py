"""popxl.addons' ``LayerNorm``: layer normalisation over the last axis."""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ipuxl import ops
from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.utils import WeightsDict
from ipuxl.dtypes import DTypeLike, float32
from ipuxl.ir.tensor import Tensor
from ipuxl.utils import to_numpy

__all__ = ["LayerNorm"]


class LayerNorm(Module):
    """Layer normalisation over the last axis with learnt ``weight`` (ones) and ``bias`` (zeros).

    Args:
        eps: added to the variance (``build``'s ``eps`` overrides it, as upstream's signature).
        cache: reuse graphs where possible.
    """

    def __init__(self, eps: float = 1e-5, cache: bool = False):
        super().__init__(cache=cache)
        self.eps = eps

    def build(self, x: Tensor, eps: float | None = None) -> Tensor:
        features = x.shape[-1]
        w = self.add_variable_input("weight", partial(np.ones, (features,)), x.dtype)
        b = self.add_variable_input("bias", partial(np.zeros, (features,)), x.dtype)
        return ops.layer_norm(x, w, b, epsilon=self.eps if eps is None else eps)

    @staticmethod
    def torch_mapping(variables: NamedTensors, nn_layer: torch.nn.LayerNorm, dtype: DTypeLike = float32) -> WeightsDict:
        """The values of ``variables`` (this layer's) taken from a ``torch.nn.LayerNorm``.

        A torch layer normalising over several trailing axes (``nn.LayerNorm([c, h, w])``)
        has weights of that shape; they are flattened to the variables' one axis, as
        upstream's (its inputs are then flattened the same way, ``(N, c * h * w)``).
        """
        weight, bias = nn_layer.weight.data, nn_layer.bias.data
        if weight.dim() > 1:
            weight, bias = weight.reshape(variables.weight.shape), bias.reshape(variables.bias.shape)
        return WeightsDict({variables.weight: to_numpy(weight, dtype), variables.bias: to_numpy(bias, dtype)})
