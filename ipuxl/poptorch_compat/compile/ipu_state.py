"""PopTorch's ``ipu_state`` / ``ipu_param``: a PopTorch optimiser's device state by PopART's names.

Upstream, ``state_dict()`` of a ``poptorch.optim`` optimiser used by a compiled
training model holds, besides torch's ``state`` and ``param_groups``:

* ``ipu_state``: the optimiser's state tensors on the device, by PopART's tensor
  names: ``Accl1___<param>`` (Adam/LAMB ``exp_avg``; RMSprop ``square_avg``; SGD's
  velocity), ``Accl2___<param>`` (``exp_avg_sq``; RMSprop ``grad_avg``),
  ``Accl3___<param>`` (AMSGrad's ``max_exp_avg_sq``; RMSprop's momentum buffer),
  ``Step___<param>`` (the step count of Adam and LAMB);
* ``ipu_param``: the optimiser's scalars on the device: per parameter
  ``learningRate___specific___<param>``, ``weightDecay___specific___<param>``,
  ``beta1___``, ``beta2___``, ``eps___``, ``maxWeightNorm___``, ``alpha___``,
  ``momentum___``, ``dampening___`` (the ones the optimiser has), PopART's compound
  ``scaledLearningRate0___specific___<param>`` (lr (1 - dampening) / loss scaling) and
  ``weightDecayScaleFactor0___specific___<param>`` (1 - lr (1 - dampening) weight
  decay) for SGD without momentum, and ``lossScaling_FLOAT``.

``<param>`` is upstream's name of the parameter in a training model
(``model.<path>``). Both are None before the model is compiled or while it was never
attached (an offline target). These functions convert between those names and
ipuxl's (``(param, state)`` of ``ipuxl.optim.rules`` and the plans' hyperparameters).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np
import torch

from ipuxl.poptorch_compat.compile.optimizer_log import popart_tensor_name
from ipuxl.poptorch_compat.compile.translate import ParamPlan

__all__ = ["STATE_PREFIXES", "state_name", "ipu_state", "ipu_param", "states_from_ipu_state", "plans_from_ipu_param"]

#: the rules' state -> PopART's prefix, per rule (SGD's ``step`` is ipuxl's first-step flag: none upstream)
STATE_PREFIXES: dict[str, dict[str, str]] = {
    "sgd": {"momentum_buffer": "Accl1___"},
    "adam": {"first_order": "Accl1___", "second_order": "Accl2___", "max_second_order": "Accl3___",
             "step": "Step___"},
    "lamb": {"first_order": "Accl1___", "second_order": "Accl2___", "step": "Step___"},
    "rmsprop": {"square_avg": "Accl1___", "grad_avg": "Accl2___", "momentum_buffer": "Accl3___"},
}
# the rules' hyperparameter -> PopART's scalar
_SCALARS = {"lr": "learningRate", "weight_decay": "weightDecay", "beta1": "beta1", "beta2": "beta2", "eps": "eps",
            "max_weight_norm": "maxWeightNorm", "alpha": "alpha", "momentum": "momentum", "dampening": "dampening"}
_SPECIFIC = "___specific___"
LOSS_SCALING = "lossScaling_FLOAT"


def _is_sgd0(plan: ParamPlan) -> bool:
    """PopART's SGD0: SGD whose momentum is a constant 0."""
    return plan.rule == "sgd" and plan.hypers.get("momentum", 0.0) == 0.0 and "momentum" not in plan.variable


def state_name(key: tuple[str, str], plans: list[ParamPlan]) -> str | None:
    """PopART's name of the state ``(param, state)`` of the rules, or None (no counterpart)."""
    param, state = key
    rule = next((plan.rule for plan in plans if plan.name == param), "")
    prefix = STATE_PREFIXES.get(rule, {}).get(state)
    return None if prefix is None else prefix + popart_tensor_name(param)


def ipu_state(device_states: Mapping[tuple[str, str], np.ndarray], plans: list[ParamPlan]) -> dict[str, torch.Tensor]:
    """``ipu_state`` from the device's states ``{(param, state): array}``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in device_states.items():
        name = state_name(key, plans)
        if name is not None:
            out[name] = torch.from_numpy(np.array(value))
    return out


def ipu_param(plans: list[ParamPlan]) -> dict[str, torch.Tensor]:
    """``ipu_param`` from the plans' hyperparameters (float32 scalars)."""
    out: dict[str, torch.Tensor] = {}
    for plan in plans:
        name = popart_tensor_name(plan.name)
        if _is_sgd0(plan):
            lr, wd = plan.hypers["lr"], plan.hypers["weight_decay"]
            kept = 1.0 - plan.hypers.get("dampening", 0.0)
            out[f"scaledLearningRate0{_SPECIFIC}{name}"] = _scalar(lr * kept / plan.loss_scaling)
            out[f"weightDecayScaleFactor0{_SPECIFIC}{name}"] = _scalar(1.0 - lr * kept * wd)
        else:
            for hyper, value in plan.hypers.items():
                out[f"{_SCALARS[hyper]}{_SPECIFIC}{name}"] = _scalar(value)
    if plans:
        out[LOSS_SCALING] = _scalar(plans[0].loss_scaling)
    return out


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def states_from_ipu_state(state: Mapping[str, Any], plans: list[ParamPlan]) -> dict[tuple[str, str], torch.Tensor]:
    """``{(param, state): tensor}`` of the entries of a loaded ``ipu_state`` ipuxl has."""
    names = {prefix + popart_tensor_name(plan.name): (plan.name, rule_state)
             for plan in plans for rule_state, prefix in STATE_PREFIXES.get(plan.rule, {}).items()}
    return {names[key]: torch.as_tensor(value) for key, value in state.items() if key in names}


def plans_from_ipu_param(param: Mapping[str, Any], plans: list[ParamPlan]) -> list[ParamPlan]:
    """The plans with the hyperparameters (and loss scaling) a loaded ``ipu_param`` gives;
    a parameter's values missing from it are kept."""
    scaling = float(torch.as_tensor(param[LOSS_SCALING])) if LOSS_SCALING in param else None
    out = []
    for plan in plans:
        name = popart_tensor_name(plan.name)
        hypers = dict(plan.hypers)
        loss_scaling = plan.loss_scaling if scaling is None else scaling
        if _is_sgd0(plan):
            kept = 1.0 - hypers.get("dampening", 0.0)
            slr, wdsf = (param.get(f"{key}{_SPECIFIC}{name}") for key in ("scaledLearningRate0",
                                                                           "weightDecayScaleFactor0"))
            if slr is not None and kept:
                hypers["lr"] = float(torch.as_tensor(slr)) * loss_scaling / kept
            if wdsf is not None and hypers["lr"] * kept:
                hypers["weight_decay"] = (1.0 - float(torch.as_tensor(wdsf))) / (hypers["lr"] * kept)
        else:
            for hyper in hypers:
                value = param.get(f"{_SCALARS[hyper]}{_SPECIFIC}{name}")
                if value is not None:
                    hypers[hyper] = float(torch.as_tensor(value))
        out.append(dataclasses.replace(plan, hypers=hypers, loss_scaling=loss_scaling))
    return out
