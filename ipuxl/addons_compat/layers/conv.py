"""popxl.addons' ``Conv2D``: 2-D convolution over NCHW input, with upstream's signature.

``Conv2D(out_channels, kernel_size, strides=(1, 1), paddings=(0, 0, 0, 0), dilations=(1, 1),
groups=1, bias=True, available_memory_proportions=None, partials_types=None,
enable_conv_dithering=None, replica_grouping=None)``:

- ``paddings`` is PopXL's explicit ``(begin_h, begin_w, end_h, end_w)``, or a pad type:
  ``"same_upper"``, ``"same_lower"`` (output size ``ceil(in / stride)``, the odd pad at the
  end or the beginning) or ``"valid"`` (no padding); ``"not_set"`` means explicit.
- the weight is ``(out_channels, in_channels / groups, k_h, k_w)`` from upstream's truncated
  normal (scale 0.02); the bias is ``(1, out_channels, 1, 1)`` zeros (upstream's shape, so it
  broadcasts over NCHW).
- ``available_memory_proportions``, ``partials_types`` and ``enable_conv_dithering`` are IPU
  tuning options: recorded and passed to ``ops.conv``, which accepts and ignores them.
- Beyond upstream: an int ``kernel_size``/``strides``/``dilations`` means the same value on
  both axes, and an int ``paddings`` the same pad on all four sides.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import numpy as np
import torch

from ipuxl import ops
from ipuxl.addons_compat.layers.init import truncated_normal
from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.utils import WeightsDict
from ipuxl.dtypes import DTypeLike, float32
from ipuxl.errors import InvalidValueError, ShapeMismatchError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor
from ipuxl.utils import to_numpy

__all__ = ["Conv2D"]

PAD_TYPES = ("same_upper", "same_lower", "valid", "not_set")


def _ints(what: str, value: int | Sequence[int], length: int) -> tuple[int, ...]:
    """``value`` as ``length`` ints (an int repeated); a sequence of another length is refused."""
    values = (value,) * length if isinstance(value, int) else tuple(int(v) for v in value)
    if len(values) != length:
        raise InvalidValueError(f"Conv2D: {what} needs {length} values, got {tuple(values)}",
                                where=user_source_line(), fix=f"give {length} ints (or one int for all)")
    return values


class Conv2D(Module):
    """2-D convolution of ``(N, C, H, W)`` input (module docstring for the arguments).

    Raises:
        InvalidValueError: (a ValueError) ``paddings`` a string other than the pad types,
            or a size with the wrong number of values.
    """

    def __init__(self, out_channels: int, kernel_size: int | tuple[int, int],
                 strides: int | Sequence[int] | None = (1, 1),
                 paddings: str | int | Sequence[int] | None = (0, 0, 0, 0),
                 dilations: int | Sequence[int] | None = (1, 1), groups: int | None = 1, bias: bool = True,
                 available_memory_proportions: list[float] | None = None, partials_types: list[str] | None = None,
                 enable_conv_dithering: list[int] | None = None, replica_grouping: ReplicaGrouping | None = None):
        super().__init__()
        self.out_channels = out_channels
        self.k_h, self.k_w = _ints("kernel_size", kernel_size, 2)
        self.strides = _ints("strides", strides if strides is not None else 1, 2)
        self.dilations = _ints("dilations", dilations if dilations is not None else 1, 2)
        self.paddings: tuple[int, ...]
        self.groups = int(groups or 1)
        if isinstance(paddings, str):
            if paddings not in PAD_TYPES:
                raise InvalidValueError(f"Conv2D: paddings {paddings!r} is not a pad type", where=user_source_line(),
                                        fix=f"use one of {PAD_TYPES[:3]}, or explicit (top, left, bottom, right)")
            self.pad_type, self.paddings = paddings, (0,) * 4
        else:
            self.pad_type = "not_set"
            self.paddings = _ints("paddings", paddings if paddings is not None else 0, 4)
        self.bias = bias
        self.replica_grouping = replica_grouping
        self.available_memory_proportions = available_memory_proportions
        self.partial_types = partials_types  # upstream's attribute name
        self.enable_conv_dithering = enable_conv_dithering

    def build(self, x: Tensor) -> Tensor:
        if x.rank != 4:
            raise ShapeMismatchError(f"Conv2D: input '{x.name}' {x.shape} must be (N, C, H, W)",
                                     where=user_source_line(), fix="reshape the input to 4 dimensions")
        kernel_shape = (self.out_channels, x.shape[1] // self.groups, self.k_h, self.k_w)
        weight = self.add_variable_input("weight", partial(truncated_normal, kernel_shape), x.dtype,
                                         replica_grouping=self.replica_grouping)
        y = ops.conv(x, weight, stride=self.strides, padding=self.paddings, dilation=self.dilations,
                     groups=self.groups, pad_type=self.pad_type,  # type: ignore[arg-type]
                     available_memory_proportions=self.available_memory_proportions,
                     partials_types=self.partial_types, enable_conv_dithering=self.enable_conv_dithering)
        if self.bias:
            bias = self.add_variable_input("bias", partial(np.zeros, (1, self.out_channels, 1, 1)), x.dtype,
                                           replica_grouping=self.replica_grouping)
            y = y + bias
        return y

    @staticmethod
    def torch_mapping(variables: NamedTensors, nn_layer: torch.nn.Conv2d, dtype: DTypeLike = float32) -> WeightsDict:
        """The values of ``variables`` (this layer's) taken from a ``torch.nn.Conv2d``: the weight as
        is, the bias reshaped to the variable's ``(1, out_channels, 1, 1)``."""
        state = {variables.weight: to_numpy(nn_layer.weight.data, dtype)}
        if "bias" in variables.keys():
            bias = nn_layer.bias
            if bias is None:
                raise InvalidValueError("Conv2D.torch_mapping: the layer has a bias, the torch Conv2d has none",
                                        fix="create the torch layer with bias=True, or Conv2D with bias=False")
            state[variables.bias] = to_numpy(bias.data, dtype).reshape(variables.bias.shape)
        return WeightsDict(state)
