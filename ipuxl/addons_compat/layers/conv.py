"""popxl.addons' ``Conv2D``: 2-D convolution over NCHW input."""
from __future__ import annotations

from functools import partial

import numpy as np

from ipuxl import ops
from ipuxl.addons_compat.layers.init import truncated_normal
from ipuxl.addons_compat.module import Module
from ipuxl.ir.tensor import Tensor

__all__ = ["Conv2D"]


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
        w = self.add_variable_input("weight", partial(truncated_normal, shape), x.dtype)
        y = ops.conv(x, w, stride=self.stride, padding=self.padding * 2, groups=self.groups)
        if self.bias:
            b = self.add_variable_input("bias", partial(np.zeros, (self.out_channels,)), x.dtype)
            y = y + b.reshape((self.out_channels, 1, 1))
        return y
