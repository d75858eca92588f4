"""A PopTorch optimiser's ``ipu_state`` / ``ipu_param`` while a training model uses it.

Upstream, ``state_dict()`` of a ``poptorch.optim`` optimiser wrapped in a compiled,
attached training model reads the device's optimiser state (``compile.ipu_state``
names it) when the device's copy is newer than the host's, logging "Writing optimiser
state tensors from IPU to host." (``poptorch:cpp``, debug), and otherwise returns the
copy it read last, logging "Using cached optimiser state dict" (``poptorch::python``,
debug). ``load_state_dict()`` with an ``ipu_state`` puts it on the device before the
next run ("Writing optimiser state tensors from host to IPU memory"), its
``ipu_param`` too. Detaching reads the state back; attaching writes it again.

ipuxl's torch optimiser already mirrors the device's state in its own ``state``
(``weight_sync``); ``IpuOptimizerState`` adds upstream's view: it is the optimiser's
``_ipu_provider``. Values of a loaded ``ipu_param`` are reported as loaded until the
next ``setOptimizer``; the device uses them for its variable hyperparameters (per
param group: the group's first parameter's value), a constant one keeps its compiled
value.
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ipuxl.poptorch_compat.compile.ipu_state import ipu_param, ipu_state, plans_from_ipu_param, states_from_ipu_state
from ipuxl.poptorch_compat.compile.translate import write_state
from ipuxl.poptorch_compat.optim_base import Optimizer
from ipuxl.poptorch_compat.poptorch_logging import cpp_logger

if TYPE_CHECKING:
    from ipuxl.poptorch_compat.runtime.compiled_model import CompiledModel

__all__ = ["IpuOptimizerState"]

_LOG = logging.getLogger("poptorch::python")


class IpuOptimizerState:
    """Upstream's optimiser state dict of one training model (see the module docstring)."""

    def __init__(self, model: CompiledModel):
        self._model = weakref.ref(model)
        self._cache: dict[str, Any] | None = None  # the last ipu_state / ipu_param read
        self._device_newer = False  # the device's state changed since the last read
        self._loaded_params: dict[str, torch.Tensor] = {}  # a loaded ipu_param, reported until setOptimizer

    # -- the optimiser ---------------------------------------------------------------------
    def adopt(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Serve ``optimizer``'s ``ipu_state``/``ipu_param`` from now on (a PopTorch optimiser
        only, as upstream); an optimiser served before keeps the state read last."""
        model = self._model()
        previous = model.optimizer if model is not None else None
        if isinstance(previous, Optimizer) and previous is not optimizer:
            previous.detach_ipu_state(self.read())
        self._loaded_params = {}
        if isinstance(optimizer, Optimizer):
            optimizer.attach_ipu_state(self)

    def compiled(self) -> None:
        """A program was compiled and attached: its state is the device's now."""
        self._device_newer = True

    def ran(self) -> None:
        self._device_newer = True

    def read(self) -> dict[str, Any] | None:
        """``{"ipu_state", "ipu_param"}`` as upstream's ``state_dict()`` gives them, or None
        (no program, or one never attached)."""
        model = self._model()
        if model is None or model._sync.compiled is None or (self._cache is None and not model._sync.attached):
            return self._cache
        if not (self._device_newer and model._sync.attached):
            _LOG.debug("Using cached optimiser state dict")
            return self._cache
        cpp_logger.debug("Writing optimiser state tensors from IPU to host.")
        params = ipu_param(model._sync.plans)
        params.update({k: v for k, v in self._loaded_params.items() if k in params})
        states = ipu_state(model._sync.device_states(), model._sync.plans)
        if model.options.toDict().get("automaticLossScalingSettings.enabled", False):
            # PopART's factor of the loss scaling's next update: automatic loss scaling has no
            # effect on ipuxl (see Training.setAutomaticLossScaling), so the scale keeps its value
            states["lossScaleUpdateFactor"] = torch.tensor(1.0)
        self._cache = {"ipu_state": states, "ipu_param": params}
        self._device_newer = False
        return self._cache

    def detached(self) -> None:
        """``detachFromDevice``: read the state back first."""
        self.read()

    def loaded(self, state: dict[str, Any]) -> None:
        """``optimizer.load_state_dict`` with ``state["ipu_state"]``/``["ipu_param"]``: they win
        over the device's from the next run."""
        model = self._model()
        if model is None or state.get("ipu_state") is None or state.get("ipu_param") is None:
            return
        apply_ipu_state(model, state)
        self._loaded_params = {k: torch.as_tensor(v).clone() for k, v in state["ipu_param"].items()}
        self._cache = {"ipu_state": {k: torch.as_tensor(v).clone() for k, v in state["ipu_state"].items()},
                       "ipu_param": {**(self._cache or {}).get("ipu_param", {}), **self._loaded_params}}
        self._device_newer = False

    def plans(self, plans: list[Any]) -> list[Any]:
        """``plans`` (a translation of the torch optimiser) with a loaded ``ipu_param``'s values."""
        return plans_from_ipu_param(self._loaded_params, plans) if self._loaded_params else plans

    def pushed(self) -> None:
        """The torch optimiser's state went to the device (before a run)."""
        cpp_logger.debug("Writing optimiser state tensors from host to IPU memory")


def apply_ipu_state(model: CompiledModel, state: dict[str, Any]) -> None:
    """Put a loaded ``ipu_state`` into ``model``'s torch optimiser's state (a loaded
    ``ipu_param`` is applied to the plans by ``IpuOptimizerState.plans``; the device
    gets both before the next run."""
    sync = model._sync
    optimizer = sync.optimizer
    assert optimizer is not None, "a training model with a PopTorch optimiser"
    params = dict(torch.nn.Module.named_parameters(model._model))
    missing = [key for key in state["ipu_state"] if key not in _known_state_names(model)]
    for key in missing:
        cpp_logger.warning("writeOptimizerState: ignoring unknown state %s", key)
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for (param, rule_state), value in states_from_ipu_state(state["ipu_state"], sync.plans).items():
        by_param.setdefault(param, {})[rule_state] = value
    for plan in sync.plans:
        if plan.name in by_param:
            write_state(optimizer, params[plan.name], plan, by_param[plan.name])
    sync.optimizer_dirty = True


def _known_state_names(model: CompiledModel) -> set[str]:
    from ipuxl.poptorch_compat.compile.ipu_state import STATE_PREFIXES
    from ipuxl.poptorch_compat.compile.optimizer_log import popart_tensor_name

    return {prefix + popart_tensor_name(plan.name) for plan in model._sync.plans
            for prefix in STATE_PREFIXES.get(plan.rule, {}).values()}
