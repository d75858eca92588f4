"""Keeping a wrapped model's host module, torch optimiser and device in step.

``weights`` says where each parameter and buffer lives (bound: the host tensor is
the device storage; copied: the device keeps its own copy). ``WeightSync`` decides
*when* values move, for one ``PoplarExecutor``:

1. a run that writes variables makes the device newer (``after_run``); the next read
   of the host module (through ``weights.install_sync_hooks``) pulls the copied
   tensors back (``pull_weights_if_newer``), and ``optimizer.state_dict()`` pulls
   the optimiser state (``pull_state_if_newer``);
2. before a run, host writes go to the device (``push_host_writes``), and other
   models holding the same tensors put their newer device values on the host first
   (``pull_shared``);
3. ``optimizer.load_state_dict()`` makes the torch optimiser's state win over the
   device's (``optimizer_loaded``): the executor sends it before the next run.

A run that fails in step k keeps steps 1..k-1 (``after_run(partial=True)``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
import numpy as np
import torch

from ipuxl.device.session import Session
from ipuxl.poptorch_compat.compile.program import Program
from ipuxl.poptorch_compat.compile.translate import ParamPlan, initial_state, write_state
from ipuxl.poptorch_compat.runtime.weights import (
    HostSlots, install_optimizer_hooks, install_sync_hooks, named_tensors, remove_sync_hooks,
)

__all__ = ["Compiled", "WeightSync"]

_LIVE: "weakref.WeakSet[WeightSync]" = weakref.WeakSet()
_GENERATION = [0]  # bumped when models come or go (sharing caches are recomputed)


def _bump_generation() -> None:
    _GENERATION[0] += 1


@dataclass
class Compiled:
    """A compiled program, the device session running it and the host slots of its variables."""

    program: Program
    session: Session
    slots: HostSlots


class WeightSync:
    """The weight and optimiser-state traffic of one wrapped model (see the module docstring).

    Attributes:
        model: the wrapped module (its parameters and buffers are the program's variables).
        training: a training model (it has optimiser state).
        optimizer: the torch optimiser whose state mirrors the device's (training), or None.
        plans: the optimiser's translation (``translate``), one plan per parameter.
        compiled: the current program and its session, or None before the first compile.
        attached: the session holds the device (``detachFromDevice`` releases it).
        optimizer_dirty: ``optimizer.load_state_dict`` ran since the last run: its
            hyperparameters and state win over the device's.
    """

    def __init__(self, model: torch.nn.Module, *, training: bool, optimizer: torch.optim.Optimizer | None,
                 plans: list[ParamPlan]):
        self.model = model
        self.training = training
        self.optimizer = optimizer
        self.plans = plans
        self.compiled: Compiled | None = None
        self.attached = False
        self.optimizer_dirty = False
        self._weights_newer = False  # device values of copied tensors not yet read back
        self._states_newer = False  # device optimiser state not yet in the torch optimiser
        self._pulling = False  # copying to the host: reads of the host module must not pull again
        self._unsynced_steps = 0  # optimiser steps on the device not yet in the host optimiser's state
        self._hooks = install_optimizer_hooks(optimizer, self) if optimizer is not None else []
        self._sharing: tuple[int, list[weakref.ref[WeightSync]]] = (-1, [])
        install_sync_hooks(model, self)
        _LIVE.add(self)
        _bump_generation()
        weakref.finalize(self, _bump_generation)

    @property
    def weights_newer(self) -> bool:
        """The device's weights changed since the host module last read them."""
        return self._weights_newer

    # -- called by the hooks on the host module and the torch optimiser ---------------------------
    def pull_weights_if_newer(self) -> None:
        """Before the host module is read: copy newer device weights back."""
        compiled = self.compiled
        if compiled is not None and self._weights_newer and self.attached and not self._pulling:
            self._pulling = True
            try:
                compiled.slots.pull(compiled.session)
                self._weights_newer = False
            finally:
                self._pulling = False

    def pull_state_if_newer(self) -> None:
        """Before ``optimizer.state_dict()``: the device's optimiser state."""
        if not self._pulling:
            self._pulling = True
            try:
                self._pull_states()
            finally:
                self._pulling = False

    def optimizer_loaded(self) -> None:
        """``optimizer.load_state_dict`` ran: its state and hyperparameters win over the device's."""
        self.optimizer_dirty = True
        self._states_newer = False
        self._unsynced_steps = 0

    # -- called by the executor -----------------------------------------------------------------
    def use(self, compiled: Compiled) -> None:
        """Run ``compiled`` from now on (attached); the previous session is closed."""
        self.close_session()
        self.compiled, self.attached = compiled, True
        self._weights_newer = self._states_newer = self.optimizer_dirty = False

    def close_session(self) -> None:
        """Release the device session (the program stays, detached)."""
        if self.compiled is not None and self.attached:
            self.compiled.session.__exit__(None, None, None)
        self.attached = False

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Mirror ``optimizer`` from now on; the previous one first gets the device's state."""
        if optimizer is self.optimizer:
            return
        self.pull_state_if_newer()
        for handle in self._hooks:
            handle.remove()
        self.optimizer = optimizer
        self._hooks = install_optimizer_hooks(optimizer, self)

    def pull(self, *, keep_host_writes: bool) -> None:
        """Device -> host: copied weights, then the optimiser state (``keep_host_writes``:
        tensors written on the host since the last sync keep their value)."""
        compiled = self._require_compiled()
        self._pulling = True
        try:
            compiled.slots.pull(compiled.session, keep_host_writes=keep_host_writes)
            self._weights_newer = False
            self._pull_states()
        finally:
            self._pulling = False

    def push(self) -> None:
        """Host -> device: every copied weight (replaced host tensors included)."""
        compiled = self._require_compiled()
        compiled.slots.host_writes(compiled.session)  # picks up replaced tensors
        compiled.slots.push(compiled.session)
        self._weights_newer = False

    def push_host_writes(self) -> None:
        """Host tensors written since the last sync go to the device (copied ones; bound
        ones are the device storage already)."""
        compiled = self._require_compiled()
        changed = compiled.slots.host_writes(compiled.session)
        if changed:
            compiled.slots.push(compiled.session, changed)

    def pull_shared(self) -> None:
        """Other models holding these tensors put their newer device values on the host."""
        for ref in self._sharing_models():
            other = ref()
            if other is not None:
                other.pull_weights_if_newer()

    def after_run(self, steps: int, *, partial: bool = False) -> None:
        """A run applied ``steps`` device iterations (``partial``: an unknown part of one more)."""
        compiled = self._require_compiled()
        if compiled.program.writes_variables and (steps or partial):
            self._weights_newer = bool(compiled.slots.copied)
            self._states_newer = bool(compiled.program.states)
        if self.training:
            self._unsynced_steps += steps

    def device_states(self) -> dict[tuple[str, str], np.ndarray]:
        """The device's optimiser state, ``{(param, state): array}``."""
        compiled = self.compiled
        if compiled is None or not compiled.program.states:
            return {}
        states = compiled.program.states
        data = compiled.session.get_tensors_data(list(states.values()))
        return {key: np.array(data[var]) for key, var in states.items()}

    def optimizer_states(self) -> dict[tuple[str, str], np.ndarray]:
        """The torch optimiser's state, as the rules' states (``{(param, state): array}``)."""
        if self.optimizer is None:
            return {}
        params = dict(torch.nn.Module.named_parameters(self.model))
        states: dict[tuple[str, str], np.ndarray] = {}
        for plan in self.plans:
            for state, value in initial_state(self.optimizer, params[plan.name], plan).items():
                states[(plan.name, state)] = value.detach().cpu().numpy()
        return states

    def device_seed(self) -> np.ndarray | None:
        """The device's random seed now, or None when the program has none."""
        compiled = self.compiled
        if compiled is None or compiled.program.seed is None:
            return None
        return np.array(compiled.session.get_tensor_data(compiled.program.seed))

    def release(self) -> None:
        """The model is destroyed: close the session, forget the program, remove the hooks."""
        self.close_session()
        self.compiled = None
        _LIVE.discard(self)
        _bump_generation()
        remove_sync_hooks(self.model, self)
        for handle in self._hooks:
            handle.remove()

    # -- helpers ------------------------------------------------------------------------------------
    def _require_compiled(self) -> Compiled:
        assert self.compiled is not None, "the executor compiles before it syncs"
        return self.compiled

    def _pull_states(self) -> None:
        """Put the device's optimiser state into the torch optimiser (``optimizer.state``)."""
        if not (self._states_newer and self.attached and self.training and self.optimizer is not None):
            return
        params = dict(torch.nn.Module.named_parameters(self.model))
        by_param: dict[str, dict[str, torch.Tensor]] = {}
        for (p, s), v in self.device_states().items():
            by_param.setdefault(p, {})[s] = torch.from_numpy(v)
        for plan in self.plans:
            mine = by_param.get(plan.name)
            if mine:
                write_state(self.optimizer, params[plan.name], plan, mine, steps_taken=self._unsynced_steps)
        self._unsynced_steps = 0
        self._states_newer = False

    def _sharing_models(self) -> list[weakref.ref[WeightSync]]:
        """The other live models holding any of this model's parameters or buffers (weakly)."""
        if self._sharing[0] != _GENERATION[0]:
            mine = {id(t) for _, t in named_tensors(self.model)}
            others = [weakref.ref(other) for other in list(_LIVE) if other is not self
                      and mine & {id(t) for _, t in named_tensors(other.model)}]
            self._sharing = (_GENERATION[0], others)
        return self._sharing[1]

