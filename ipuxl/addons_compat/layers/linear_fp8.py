"""popxl.addons' ``LinearFP8``: a linear layer whose matmuls run in float8.

The forward pass scales the weight and the input by powers of two chosen by
``scale_metric`` ("amax": ``fp8_amax_scale``, "mse": ``fp8_mse_scale``, "manual_scale":
the fixed ``scale``), casts both to ``float8_143`` and multiplies them with
``ops.matmul_pow2scaled`` (float16 result, unscaled by the sum of the two scales), then
adds the bias. ``build_grad`` is the backward pass, also in float8: the incoming gradient
is scaled for ``float8_152`` (three binades lower, for headroom, clipped to [-31, 31]) and
multiplied with the saved float8 weight and input.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np
import torch

from ipuxl import ops
from ipuxl.addons_compat.layers.init import truncated_normal
from ipuxl.addons_compat.layers.linear import Linear
from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.ops.fp8_amax_scale import SCALE_RANGE, fp8_amax_scale
from ipuxl.addons_compat.ops.fp8_mse_scale import fp8_mse_scale
from ipuxl.dtypes import DTypeLike, float8_143, float8_152, float32
from ipuxl.errors import InvalidValueError
from ipuxl.ir import context
from ipuxl.ir.graph_builder import constant
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor

__all__ = ["LinearFP8"]

#: the scale metrics ``LinearFP8`` takes
SCALE_METRICS = ("amax", "mse", "manual_scale")


class LinearFP8(Module):
    """``x @ weight + bias`` with ``weight`` of shape ``(in, out_features)``, the matmuls in float8.

    Args:
        out_features: the output size.
        bias: add a ``bias`` of shape ``(out_features,)``.
        scale_metric: how the float8 scales are chosen: "amax", "mse" or "manual_scale".
        scale: the log2 scale of every cast with "manual_scale".
        replica_grouping: the grouping of the variables.

    Raises:
        InvalidValueError: (a ValueError, as upstream) another ``scale_metric``.
    """

    def __init__(self, out_features: int, bias: bool = True, scale_metric: str = "amax", scale: int = 0,
                 replica_grouping: ReplicaGrouping | None = None):
        super().__init__()
        self.out_features = out_features
        self.bias = bias
        self.replica_grouping = replica_grouping
        self.scale_metric = scale_metric
        self.scale = scale
        self.forward_fp8_type = float8_143
        self.grad_fp8_type = float8_152
        if scale_metric not in SCALE_METRICS:
            raise InvalidValueError(f"The scale_metric option {scale_metric} is not available. Please provide one "
                                    "of the following options: amax, mse or manual_scale.",
                                    where=context.user_source_line(), fix="pass amax, mse or manual_scale")
        #: ``fp8_scale(t, dtype)``: the int32 log2 scale for casting ``t`` to ``dtype`` (as upstream, replaceable)
        self.fp8_scale: Callable[..., Tensor] = self._manual_scale
        if scale_metric == "amax":
            self.fp8_scale = fp8_amax_scale
        elif scale_metric == "mse":
            self.fp8_scale = fp8_mse_scale

    def _manual_scale(self, t: Tensor, dtype: DTypeLike) -> Tensor:
        return constant(self.scale)

    def build(self, x: Tensor) -> Tensor:
        w = self.add_variable_input("weight", partial(truncated_normal, (x.shape[-1], self.out_features)), x.dtype,
                                    replica_grouping=self.replica_grouping)
        w_log2scale = self.fp8_scale(w, float8_143)
        w_fp8 = ops.pow2scale_cast_to_fp8(w, data_type=self.forward_fp8_type, log2_scale=w_log2scale)
        x_log2scale = self.fp8_scale(x, float8_143)
        x_fp8 = ops.pow2scale_cast_to_fp8(x, data_type=self.forward_fp8_type, log2_scale=x_log2scale)
        self.aux["w_log2scale"] = w_log2scale
        self.aux["w_fp8"] = w_fp8
        self.aux["x_log2scale"] = x_log2scale
        self.aux["x_fp8"] = x_fp8
        y = ops.matmul_pow2scaled(x_fp8, w_fp8, log2_scale=-w_log2scale - x_log2scale)  # float16
        if x.dtype == float32:
            y = ops.cast(y, torch.float32)
        if self.bias:
            b = self.add_variable_input("bias", partial(np.zeros, y.shape[-1]), x.dtype,
                                        replica_grouping=self.replica_grouping)
            y = y + b
        return y

    def build_grad(self, dLdy: Tensor) -> Tensor:  # type: ignore[override]  # noqa: N803 - upstream's
        """The backward pass in float8: ``dLdx`` (returned), the weight's and bias's gradients
        (in ``var_grad``)."""
        # three binades of headroom against overflow in the scaled matmuls
        dLdy_log2scale = ops.clip(self.fp8_scale(dLdy, float8_152) - constant(3), *SCALE_RANGE)  # noqa: N806
        dLdy_fp8 = ops.pow2scale_cast_to_fp8(dLdy, data_type=self.grad_fp8_type,  # noqa: N806
                                             log2_scale=dLdy_log2scale)
        dLdx = ops.matmul_pow2scaled(dLdy_fp8, self.aux["w_fp8"].T,  # noqa: N806
                                     log2_scale=-self.aux["w_log2scale"] - dLdy_log2scale)
        dLdw = ops.matmul_pow2scaled(dLdy_fp8.T, self.aux["x_fp8"],  # noqa: N806
                                     log2_scale=-self.aux["x_log2scale"] - dLdy_log2scale).T
        self.var_grad["weight"] = dLdw
        if self.bias:
            self.var_grad["bias"] = ops.sum(dLdy, 0)
        return dLdx

    torch_mapping = staticmethod(Linear.torch_mapping)  # the same variables as ``Linear``: weight (in, out), bias
