"""Graph optimisers as popxl.addons-style Modules, and a helper applying one to many variables.

Each module's ``build(weight, grad, **hyperparameters)`` declares the optimiser
state it needs as by-reference named inputs (zeros, in the dtypes chosen when the
module is made) and applies the shared update rule of ``ipuxl.optim.rules`` in
place. Hyperparameters given as numbers are baked in; given as tensors (or
TensorSpecs at ``create_graph``) they are graph inputs, changeable at run time.

The names end in ``Update`` so they never clash with the torch.optim-style classes
of the PopTorch front end, which are built on the same rules.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir import context
from ipuxl.ir.context import in_sequence
from ipuxl.ir.tensor import Tensor, TensorByRef
from ipuxl.optim.rules import RULES, state_specs

__all__ = ["SGDUpdate", "AdamUpdate", "AdamWUpdate", "LAMBUpdate", "RMSpropUpdate", "apply_optimizer"]


class _RuleUpdate(Module):
    """An optimiser for one weight: state as named inputs, the update rule in place."""

    rule = ""
    fixed: dict[str, Any] = {}

    def __init__(self, cache: bool = True, **state_dtypes: torch.dtype):
        """Args: cache: reuse one graph per weight spec; ``<state>_dtype``: dtype of a state
        (e.g. ``first_order_dtype``)."""
        super().__init__(cache=cache)
        self.state_dtypes = state_dtypes

    @in_sequence()
    def build(self, weight: TensorByRef, grad: Tensor, **hyperparameters: Any) -> None:
        options = {**self.fixed, **hyperparameters}
        specs = state_specs(self.rule, weight, **options, **self.state_dtypes)
        states = {name: self.add_variable_input(name, spec.zeros, spec.dtype, by_ref=True)
                  for name, spec in specs.items()}
        RULES[self.rule](weight, grad, **states, **options)


class SGDUpdate(_RuleUpdate):
    """torch.optim.SGD: ``lr``, ``momentum``, ``dampening``, ``nesterov``, ``weight_decay``."""

    rule = "sgd"


class AdamUpdate(_RuleUpdate):
    """torch.optim.Adam: ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` (L2), ``amsgrad``,
    ``bias_correction``."""

    rule = "adam"


class AdamWUpdate(_RuleUpdate):
    """torch.optim.AdamW: Adam with decoupled weight decay."""

    rule = "adamw"
    fixed = {"decoupled_weight_decay": True}


class LAMBUpdate(_RuleUpdate):
    """LAMB: Adam's update scaled by the trust ratio ``|w| / |update|``."""

    rule = "lamb"


class RMSpropUpdate(_RuleUpdate):
    """torch.optim.RMSprop: ``lr``, ``alpha``, ``eps``, ``weight_decay``, ``momentum``, ``centered``."""

    rule = "rmsprop"


def apply_optimizer(optimizer: _RuleUpdate, variables: NamedTensors, grads: Mapping[Tensor, Tensor],
                    **hyperparameters: Any) -> NamedTensors:
    """Update every variable of ``variables`` with its gradient from ``grads``.

    One optimiser graph is built per distinct (weight, gradient) spec and reused
    (the module caches graphs); each variable gets its own state variables, created
    in the main graph and returned under the variable's name.

    Raises:
        InvalidArgumentError: a variable has no gradient in ``grads``.
    """
    named = sorted(variables.named_tensors.items())
    missing = [name for name, var in named if var not in grads]
    if missing:
        raise InvalidArgumentError(
            f"{type(optimizer).__name__}: no gradient for variables {missing}", where=context.user_source_line(),
            fix="pass the gradients of every variable (grads_required of autodiff), or only the variables to update")
    tensor_hypers = [v for v in hyperparameters.values() if isinstance(v, Tensor)]
    states = {}
    for name, var in named:
        factories, graph = optimizer.create_graph(var, grads[var], **hyperparameters)
        state = factories.init(prefix=name)
        graph.bind(state).call(var, grads[var], *tensor_hypers)
        if state.len_flat():
            states[name] = state
    return NamedTensors.from_dict(states)  # dotted names share subtrees ("fc1.weight", "fc1.bias")
