"""What PopTorch's backend logs when it sets up or updates a model's optimiser.

Upstream's backend turns the optimiser into PopART's (``SGD``, ``Adam``, ``Adaptive``)
and logs it at debug level (logger ``poptorch:cpp``), once when the model is compiled
and again whenever ``setOptimizer`` gives it different values:

* ``Updating graph optimizer with <TYPE>, <attribute>=<value>[ (const)], ...`` for the
  optimiser's defaults (PopART's ``default`` names: ``defaultLearningRate``...,
  ``lossScaling``), then its accumulator types for the optimisers that have them
  (``accumType=float32, firstOrderMomentumAccumType=..., secondOrderMomentumAccumType=...``);
* ``Updating group <g> optimizer with <TYPE>, <attribute>=<value>[ (const)], ... for
  (tensors affected [<names>])`` for each param group.

Attributes are PopART's names in alphabetical order, values as C++ streams a float
(``0.01``, ``1e-08``, ``2``), `` (const)`` after a constant attribute (PopTorch's
``VariableAttributes``, ``translate.variable_hypers``). ``OptimizerLog`` logs the lines
of an optimiser unless they are the ones logged last, as upstream only sends an
optimiser that changed. The tensor names are upstream's: a training model's parameter
``lin.weight`` is ``model.lin.weight``.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ipuxl.poptorch_compat import optim as poptorch_optim
from ipuxl.poptorch_compat.compile.translate import upstream_type as optimizer_type, variable_hypers
from ipuxl.poptorch_compat.optim_base import INF, LAMB_MAX_WEIGHT_NORM, number
from ipuxl.poptorch_compat.poptorch_logging import cpp_logger

__all__ = ["OptimizerLog", "optimizer_type", "optimizer_lines", "popart_tensor_name"]

_TRAINING_PREFIX = "model."  # upstream's training wrapper holds the user's module as ``model``


def popart_tensor_name(param: str, *, training: bool = True) -> str:
    """Upstream's PopART name of the parameter ``param`` (``model.`` first in training)."""
    return _TRAINING_PREFIX + param if training else param


# (PopART's attribute, the attribute in a param group) per optimiser family
_ATTRIBUTES: dict[str, tuple[tuple[str, str], ...]] = {
    "SGD": (("learningRate", "lr"), ("weightDecay", "weight_decay"), ("momentum", "momentum"),
            ("dampening", "dampening"), ("velocityScaling", "velocity_scaling"), ("nesterov", "nesterov")),
    "ADAM": (("learningRate", "lr"), ("weightDecay", "weight_decay"), ("beta1", "betas"), ("beta2", "betas"),
             ("eps", "eps")),
    "LAMB": (("learningRate", "lr"), ("weightDecay", "weight_decay"), ("beta1", "betas"), ("beta2", "betas"),
             ("eps", "eps"), ("maxWeightNorm", "max_weight_norm")),
    "RMSPROP": (("learningRate", "lr"), ("weightDecay", "weight_decay"), ("alpha", "alpha"),
                ("momentum", "momentum"), ("eps", "eps")),
}
# PopART's attribute -> ``variable_hypers``'s name for it
_HYPER = {"learningRate": "lr", "weightDecay": "weight_decay", "momentum": "momentum", "dampening": "dampening",
          "beta1": "beta1", "beta2": "beta2", "eps": "eps", "alpha": "alpha", "maxWeightNorm": "max_weight_norm"}


def _family(kind: str) -> str:
    for family in ("SGD", "LAMB", "RMSPROP", "ADAM"):
        if kind.startswith(family):
            return family
    return kind


def _value(attribute: str, source: dict[str, Any], optimizer: torch.optim.Optimizer) -> float:
    if attribute in ("beta1", "beta2"):
        return number(source["betas"][0 if attribute == "beta1" else 1])
    if attribute == "velocityScaling":
        if not getattr(optimizer, "use_combined_accum", False):  # the separate variant: the loss scaling
            return number(getattr(optimizer, "loss_scaling", 1.0))
        return number(source.get("velocity_scaling", 1.0))
    if attribute == "maxWeightNorm":
        value = source.get("max_weight_norm")
        return LAMB_MAX_WEIGHT_NORM if value is None else number(value)
    if attribute == "nesterov":
        return float(bool(source.get("nesterov", False)))
    key = dict(_ATTRIBUTES[_family(optimizer_type(optimizer))])[attribute]
    return number(source.get(key, 0.0))


def _constants(optimizer: torch.optim.Optimizer, source: dict[str, Any]) -> frozenset[str]:
    """PopART's attributes of ``source`` (a param group or the defaults) that are constant."""
    family = _family(optimizer_type(optimizer))
    hypers = {_HYPER[a]: _value(a, source, optimizer) for a, _ in _ATTRIBUTES[family] if a in _HYPER}
    loss_scaling = number(getattr(optimizer, "loss_scaling", 1.0))
    variable = variable_hypers(optimizer, hypers, loss_scaling,
                               decoupled=bool(source.get("decoupled_weight_decay", False)))
    constant = {a for a, _ in _ATTRIBUTES[family] if a in _HYPER and _HYPER[a] not in variable}
    if family == "SGD":
        constant.add("nesterov")
        if "loss_scaling" not in variable and not getattr(optimizer, "use_combined_accum", False):
            constant.add("velocityScaling")
        elif getattr(optimizer, "use_combined_accum", False) and not _marked_variable(optimizer, "velocity_scaling"):
            constant.add("velocityScaling")
    if "loss_scaling" not in variable:
        constant.add("lossScaling")
    return frozenset(constant)


def _marked_variable(optimizer: torch.optim.Optimizer, attribute: str) -> bool:
    marks = getattr(optimizer, "variable_attrs", None)
    return isinstance(marks, poptorch_optim.VariableAttributes) and not marks.isConstant(attribute)


def _text(value: float) -> str:
    if value == INF:
        return "inf"
    return f"{value:g}"


def _attributes(optimizer: torch.optim.Optimizer, source: dict[str, Any], *, default: bool) -> str:
    family = _family(optimizer_type(optimizer))
    values = {a: _value(a, source, optimizer) for a, _ in _ATTRIBUTES[family]}
    constant = _constants(optimizer, source)
    names = {a: ("default" + a[0].upper() + a[1:]) if default else a for a in values}
    if default:
        values["lossScaling"], names["lossScaling"] = number(getattr(optimizer, "loss_scaling", 1.0)), "lossScaling"
    parts = sorted((names[a], values[a], a in constant) for a in values)
    return "".join(f", {name}={_text(value)}{' (const)' if is_const else ''}" for name, value, is_const in parts)


def _dtype_name(dtype: Any, params: list[torch.Tensor]) -> str:
    if dtype is None:  # ipuxl: the weight's dtype
        dtype = params[0].dtype if params else torch.float32
    return "float16" if dtype == torch.float16 else "float32"


def _accum_types(optimizer: torch.optim.Optimizer) -> str:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    accum = _dtype_name(getattr(optimizer, "accum_type", torch.float32), params)
    if _family(optimizer_type(optimizer)) == "SGD":
        first = _dtype_name(getattr(optimizer, "velocity_accum_type", torch.float32), params)
        second = "float32"
    else:
        first = _dtype_name(getattr(optimizer, "first_order_momentum_accum_type", torch.float32), params)
        second = _dtype_name(getattr(optimizer, "second_order_momentum_accum_type", torch.float32), params)
    return f", accumType={accum}, firstOrderMomentumAccumType={first}, secondOrderMomentumAccumType={second}"


def optimizer_lines(optimizer: torch.optim.Optimizer, names: dict[int, str], *, training: bool = True) -> list[str]:
    """Upstream's debug lines for ``optimizer`` (see the module docstring); ``names``
    maps ``id(parameter)`` to its name in the model."""
    kind = optimizer_type(optimizer)
    lines = [f"Updating graph optimizer with {kind}{_attributes(optimizer, optimizer.defaults, default=True)}"
             f"{_accum_types(optimizer)}"]
    for index, group in enumerate(optimizer.param_groups):
        tensors = [popart_tensor_name(names[id(p)], training=training) for p in group["params"] if id(p) in names]
        lines.append(f"Updating group {index} optimizer with {kind}{_attributes(optimizer, group, default=False)}"
                     f"{_accum_types(optimizer)} for (tensors affected [{', '.join(tensors)}])")
    return lines


class OptimizerLog:
    """Logs an optimiser's lines (``optimizer_lines``) when they differ from the last ones logged."""

    def __init__(self, names: dict[int, str]):
        self._names = names
        self._last: list[str] | None = None

    def log(self, optimizer: torch.optim.Optimizer) -> None:
        """Log ``optimizer`` as upstream's backend does when it receives it (at debug level:
        the lines are compared whatever the level, as upstream sends only a changed one)."""
        lines = optimizer_lines(optimizer, self._names)
        if lines == self._last:
            return
        self._last = lines
        if cpp_logger.isEnabledFor(logging.DEBUG):
            for line in lines:
                cpp_logger.debug(line)
