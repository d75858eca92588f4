"""Common layers as popxl.addons Modules: Linear, LayerNorm, GroupNorm, Embedding, Conv2D.

Initialisation follows popxl.addons' layers: weights ~ N(0, 0.02), biases zero,
LayerNorm scale one.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from ipuxl import ops
from ipuxl.dtypes import DTypeLike
from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.ir.tensor import Tensor
from ipuxl.utils import to_numpy

__all__ = ["Linear", "LayerNorm", "GroupNorm", "Embedding", "Conv2D"]


class Linear(Module):
    """``x @ weight + bias`` with ``weight`` of shape ``(in, out_features)``."""

    def __init__(self, out_features: int, bias: bool = True, cache: bool = False):
        super().__init__(cache=cache)
        self.out_features = out_features
        self.bias = bias

    def build(self, x: Tensor) -> Tensor:
        w = self.add_variable_input("weight", partial(np.random.normal, 0, 0.02, (x.shape[-1], self.out_features)),
                                    x.dtype)
        y = x @ w
        if self.bias:
            y = y + self.add_variable_input("bias", partial(np.zeros, (self.out_features,)), x.dtype)
        return y


class LayerNorm(Module):
    """Layer normalisation over the last axis with learnt ``weight`` and ``bias``."""

    def __init__(self, eps: float = 1e-5, cache: bool = False):
        super().__init__(cache=cache)
        self.eps = eps

    def build(self, x: Tensor) -> Tensor:
        features = x.shape[-1]
        w = self.add_variable_input("weight", partial(np.ones, (features,)), x.dtype)
        b = self.add_variable_input("bias", partial(np.zeros, (features,)), x.dtype)
        return ops.layer_norm(x, w, b, epsilon=self.eps)


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


class Embedding(Module):
    """Rows of a ``(vocab_size, hidden_size)`` table gathered by integer indices."""

    def __init__(self, dtype: DTypeLike, vocab_size: int, hidden_size: int, cache: bool = False):
        super().__init__(cache=cache)
        self.dtype, self.vocab_size, self.hidden_size = dtype, vocab_size, hidden_size

    def build(self, indices: Tensor) -> Tensor:
        table = self.add_variable_input("weight", partial(np.random.normal, 0, 0.02,
                                                          (self.vocab_size, self.hidden_size)), self.dtype)
        return ops.gather(table, indices)


class Conv2D(Module):
    """2-D convolution over NCHW input with a ``(out, in/groups, kh, kw)`` weight."""

    def __init__(self, out_channels: int, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] = 1,
                 padding: int | tuple[int, int] = 0, groups: int = 1, bias: bool = True, cache: bool = False):
        super().__init__(cache=cache)
        pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
        self.out_channels, self.kernel_size = out_channels, pair(kernel_size)
        self.stride, self.padding, self.groups, self.bias = pair(stride), pair(padding), groups, bias

    def build(self, x: Tensor) -> Tensor:
        shape = (self.out_channels, x.shape[1] // self.groups, *self.kernel_size)
        w = self.add_variable_input("weight", partial(np.random.normal, 0, 0.02, shape), x.dtype)
        y = ops.conv(x, w, stride=self.stride, padding=self.padding * 2, groups=self.groups)
        if self.bias:
            b = self.add_variable_input("bias", partial(np.zeros, (self.out_channels,)), x.dtype)
            y = y + b.reshape((self.out_channels, 1, 1))
        return y
