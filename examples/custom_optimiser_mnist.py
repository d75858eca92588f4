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


class EagerAdam(torch.optim.Optimizer):
    """The eager reference: the ``Adam`` Module's update in torch, as built above (no bias
    correction, eps 1e-5, a float16 first moment, factors rounded to float32 as PopART
    stores them). torch.optim.Adam is another algorithm (bias-corrected, eps 1e-8): its
    accuracy differs by more than the comparison's point on some machines."""

    def __init__(self, params, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-5):
        super().__init__(params, dict(lr=lr, beta1=float(np.float32(beta1)), beta2=float(np.float32(beta2)), eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["first_order"] = torch.zeros_like(p, dtype=torch.float16)
                    state["second_order"] = torch.zeros_like(p, dtype=torch.float32)
                m, v, g = state["first_order"], state["second_order"], p.grad
                m.lerp_(g.to(m.dtype), 1 - group["beta1"])
                v.mul_(group["beta2"]).addcmul_(g, g, value=1 - group["beta2"])
                p.sub_(group["lr"] * (m.float() / (v.sqrt() + group["eps"])))


def main(argv: list[str] | None = None) -> Result:
    opts = parse_args(argv, 1e-3, "Custom Adam optimiser MNIST (seed 004) on ipuxl")
    return run(opts, adam_step, lambda params: EagerAdam(params, lr=opts.lr))


if __name__ == "__main__":
    main()
