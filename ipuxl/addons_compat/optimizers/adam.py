"""popxl.addons' ``AdamOptimizerStep``: Adam (with decoupled weight decay) for one variable."""
from __future__ import annotations

from functools import partial
from typing import Any, cast

import torch

import numpy as np

from ipuxl import dtypes, ops
from ipuxl.addons_compat.module import Module
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir import context
from ipuxl.ir.context import in_sequence
from ipuxl.ir.graph_builder import constant
from ipuxl.ir.tensor import Tensor, TensorByRef

__all__ = ["AdamOptimizerStep"]


class AdamOptimizerStep(Module):
    """One Adam step of ``var`` in place, its moments as by-reference named inputs.

    ``first_order`` (in ``first_order_dtype``) and ``second_order`` (float32) are moving
    averages of ``grad`` and ``grad**2``; with ``bias_correction`` a ``step`` counter
    corrects their bias. The update ``m / (sqrt(v) + eps) + weight_decay * var`` is
    applied as ``var -= lr * update``. ``grad`` is first divided by ``loss_scaling``
    and, with ``global_norm``, scaled by ``global_norm_max / max(global_norm, global_norm_max)``.

    A replica-sharded ``var`` (with a ``meta_shape``: each replica of ``replica_grouping``
    holds a shard) gets replica-sharded moments, as upstream: each replica updates its
    shard with its shard of the gradient.
    """

    @in_sequence()
    def build(self, var: TensorByRef, grad: Tensor, replica_grouping: Any = None, *,
              lr: float | Tensor, beta1: float | Tensor = 0.9, beta2: float | Tensor = 0.999,
              eps: float | Tensor = 1e-5, weight_decay: float | Tensor = 1e-2,
              first_order_dtype: Any = dtypes.float16, bias_correction: bool = True,
              loss_scaling: float | Tensor = 1, global_norm: Tensor | None = None,
              global_norm_max: float | Tensor | None = None) -> None:
        weight = cast(Tensor, var)  # by reference: the caller's variable itself
        grad = self._scaled(grad, loss_scaling, global_norm, global_norm_max)
        rg = replica_grouping or context.gcg().ir.replica_grouping()
        first = self._moment("first_order", weight, first_order_dtype, rg)
        ops.var_updates.accumulate_moving_average_(first, grad, f=beta1)
        second = self._moment("second_order", weight, dtypes.float32, rg)
        ops.var_updates.accumulate_moving_average_square_(second, grad, f=beta2)
        step = (self.add_variable_input("step", partial(np.zeros, ()), dtypes.float32, by_ref=True)
                if bias_correction else None)
        updater = ops.var_updates.adam_updater(first, second, weight=weight, weight_decay=weight_decay,
                                               time_step=step, beta1=beta1, beta2=beta2, epsilon=eps)
        ops.scaled_add_(weight, updater, b=-lr)

    def _moment(self, name: str, weight: Tensor, dtype: Any, rg: Any) -> Tensor:
        """A by-reference moment of ``weight``'s shape (its shard's, sharded the same way)."""
        if weight.meta_shape:
            shard_over = int(np.prod(weight.meta_shape)) // weight.nelms
            return self.add_replica_sharded_variable_input(name, partial(np.zeros, weight.meta_shape), dtype,
                                                           by_ref=True, replica_grouping=rg, shard_over=shard_over)
        return self.add_variable_input(name, partial(np.zeros, weight.shape), dtype, by_ref=True, replica_grouping=rg)

    @staticmethod
    def _scaled(grad: Tensor, loss_scaling: float | Tensor, global_norm: Tensor | None,
                global_norm_max: float | Tensor | None) -> Tensor:
        unscaled = not isinstance(loss_scaling, Tensor) and loss_scaling == 1
        scale: Any = 1 if unscaled else 1 / loss_scaling
        if global_norm is not None:
            if global_norm_max is None:
                raise InvalidArgumentError("AdamOptimizerStep: global_norm given without global_norm_max",
                                           where=context.user_source_line(), fix="pass global_norm_max too")
            if not isinstance(global_norm_max, Tensor):
                global_norm_max = constant(global_norm_max, dtypes.float32, name="global_norm_max")
            scale = (scale * global_norm_max) / ops.maximum(global_norm, global_norm_max)
        if isinstance(scale, Tensor) or scale != 1:
            grad = ops.cast(grad, torch.float32) * scale
        return grad
