"""Seed 004: a custom Adam optimiser as a popxl.addons Module, training MNIST, with ipuxl.

The optimiser's state (first moment in float16, second moment, step) is declared
with ``add_variable_input`` and updated in place with ``ops.var_updates``; one graph
per distinct weight shape thanks to ``Adam(cache=True)``.

Run: ``python examples/custom_optimiser_mnist.py --data-dir ../shared/datasets``
"""
from __future__ import annotations

import os
import sys
from functools import partial
from typing import Dict, Union

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ipuxl  # noqa: E402
import ipuxl.addons_compat as addons  # noqa: E402
import ipuxl.ops as ops  # noqa: E402
from addons_mnist import Result, parse_args, run  # noqa: E402


class Adam(addons.Module):
    @ipuxl.in_sequence()
    def build(
        self,
        weight: ipuxl.TensorByRef,
        grad: ipuxl.Tensor,
        *,
        lr: Union[float, ipuxl.Tensor],
        beta1: Union[float, ipuxl.Tensor] = 0.9,
        beta2: Union[float, ipuxl.Tensor] = 0.999,
        eps: Union[float, ipuxl.Tensor] = 1e-5,
        weight_decay: Union[float, ipuxl.Tensor] = 0.0,
        first_order_dtype: ipuxl.dtype = ipuxl.float16,
        bias_correction: bool = True,
    ):
        first_order = self.add_variable_input(
            "first_order", partial(np.zeros, weight.shape), first_order_dtype, by_ref=True)
        ops.var_updates.accumulate_moving_average_(first_order, grad, f=beta1)
        second_order = self.add_variable_input(
            "second_order", partial(np.zeros, weight.shape), ipuxl.float32, by_ref=True)
        ops.var_updates.accumulate_moving_average_square_(second_order, grad, f=beta2)
        step = None
        if bias_correction:
            step = self.add_variable_input("step", partial(np.zeros, ()), ipuxl.float32, by_ref=True)
        dw = ops.var_updates.adam_updater(
            first_order, second_order, weight=weight, weight_decay=weight_decay, time_step=step,
            beta1=beta1, beta2=beta2, epsilon=eps)
        ops.scaled_add_(weight, dw, b=-lr)


def optimiser_step(variables: addons.NamedTensors, grads: Dict[ipuxl.Tensor, ipuxl.Tensor],
                   optimiser: addons.Module, learning_rate: float = 1e-3) -> None:
    """Update all variables, one optimiser graph call (and state) per variable."""
    for name, var in variables.named_tensors.items():
        opt_facts, opt_graph = optimiser.create_graph(
            var, var.spec, lr=learning_rate, weight_decay=0.0, bias_correction=False)
        state = opt_facts.init()
        opt_graph.bind(state).call(var, grads[var])


def adam_step(variables: addons.NamedTensors, grads: Dict[ipuxl.Tensor, ipuxl.Tensor], lr: float) -> None:
    optimiser_step(variables, grads, Adam(cache=True), lr)


def main(argv: list[str] | None = None) -> Result:
    opts = parse_args(argv, 1e-3, "Custom Adam optimiser MNIST (seed 004) on ipuxl")
    return run(opts, adam_step, lambda params: torch.optim.Adam(params, lr=opts.lr))


if __name__ == "__main__":
    main()
