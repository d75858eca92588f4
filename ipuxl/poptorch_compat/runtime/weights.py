"""Where a wrapped model's weights live: one rule, so host and device never disagree.

A ``PoplarExecutor`` runs its module's parameters and buffers as device variables.
For each of them (a *slot*) one of two things holds:

* **bound** (the usual case: the CPU devices, one replica in this process): the
  host tensor *is* the device storage (``Session(storage=...)``). The program
  updates the module's own tensors in place, so every read, write, checkpoint,
  pickle or deepcopy of the module sees the device's values, with no copy.
* **copied** (a CUDA device, several replicas in this process, a host tensor of
  another dtype or not contiguous, or a tensor the user replaced after compiling):
  the device keeps its own copy. Then

  1. after a run that writes variables the device is newer; any read of the host
     module (attribute access, ``parameters()``, ``state_dict()``, pickling,
     ``copy.deepcopy``, ``.to()``...) first copies the device's values back
     (``pull``), through the module classes swapped in by ``install_sync_hooks``;
  2. a host write since the last sync (an in-place edit, ``load_state_dict``...) is
     seen by the tensor's version counter, or by a new tensor object or new data
     (``p.data = t``) in the module; it reaches the device before the next run
     (``push``) and wins over device values not read yet (a pull skips it).
     In-place writes through ``.data`` bypass version counters: in copied mode they
     are not seen (use ``torch.no_grad()`` writes or ``copyWeightsToDevice()``).

A bound tensor replaced in the module gets the device storage moved to it (or, when
it cannot be bound, to a private copy), so device writes never share a version
counter with what the host module holds.

Optimiser state (momentum, Adam moments) always lives on the device; the torch
optimiser's ``state_dict()`` reads it back first and its ``load_state_dict()``
sends the loaded state before the next run (``install_optimizer_hooks``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol

import numpy as np
import torch

from ipuxl.dtypes import dtype_name
from ipuxl.errors import ExecutorError, InvalidArgumentError
from ipuxl.ir.context import user_source_line

if TYPE_CHECKING:
    from ipuxl.device.session import Session
    from ipuxl.ir.tensor import Variable

__all__ = ["Slot", "HostSlots", "SyncTarget", "named_tensors", "to_numpy", "host_view", "install_sync_hooks", "remove_sync_hooks",
           "install_optimizer_hooks"]

_EXECUTORS = "_ipuxl_executors"  # the attribute of a synced module holding its SyncTargets (weakly)


class SyncTarget(Protocol):
    """What the hooks installed here call: ``weight_sync.WeightSync``."""

    def pull_weights_if_newer(self) -> None:
        """Before the host module is read: copy newer device weights back."""

    def pull_state_if_newer(self) -> None:
        """Before ``optimizer.state_dict()``: the device's optimiser state."""

    def optimizer_loaded(self) -> None:
        """``optimizer.load_state_dict`` ran: its state wins over the device's."""


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters then buffers, read without triggering the sync hooks."""
    yield from torch.nn.Module.named_parameters(model)
    yield from torch.nn.Module.named_buffers(model)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A copy of ``t``'s data as a numpy array (bfloat16, which numpy lacks, as float32)."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()


def host_view(t: torch.Tensor) -> np.ndarray:
    """``t``'s data as a numpy array sharing its memory where numpy can (a contiguous CPU
    tensor of a numpy dtype), else a copy (``to_numpy``): a new program's IR starts from
    the host weights without holding a second copy of them."""
    t = t.detach()
    if t.device.type == "cpu" and t.dtype != torch.bfloat16 and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return t.numpy()
    return to_numpy(t)


def _owner(model: torch.nn.Module, name: str) -> tuple[dict[str, Any], str]:
    """The ``_parameters``/``_buffers`` dict holding ``name`` and its key there."""
    *path, key = name.split(".")
    module = model
    for part in path:
        child = module._modules[part]
        assert child is not None, name
        module = child
    return (module._parameters if key in module._parameters else module._buffers), key


@dataclass
class Slot:
    """One parameter or buffer: its device variable and the host tensor last synced."""

    name: str
    owner: dict[str, Any]  # the module's _parameters or _buffers
    key: str
    var: "Variable"
    host: torch.Tensor
    bound: bool  # the host tensor is the device storage
    version: int = 0  # host._version when last synced (copied slots)
    ptr: int = 0  # host.data_ptr(): a new ``.data`` (e.g. from ``.double()``) is a new tensor

    def current(self) -> torch.Tensor | None:
        return self.owner.get(self.key)


class HostSlots:
    """The slots of one compiled program (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, variables: dict[str, "Variable"], *, device: torch.device,
                 bind: bool):
        self.slots: list[Slot] = []
        for name, var in variables.items():
            owner, key = _owner(model, name)
            if owner.get(key) is None:  # forward deleted it while traced (PopTorch's message for a buffer)
                raise ExecutorError(f"Buffer {name} is removed from the model when calling the forward method.",
                                    where=user_source_line(),
                                    fix=f"keep {name} in the module; to change its value, write to it in place "
                                        f"(self.{name}.copy_(src))")
            host = owner[key]
            bound = bind and _bindable(host, var, device)
            self.slots.append(Slot(name, owner, key, var, host, bound, _version(host), host.data_ptr()))
        self.copied = [s for s in self.slots if not s.bound]

    def storage(self) -> dict["Variable", torch.Tensor]:
        """``Session(storage=...)``: the host tensors that are the device storage."""
        return {s.var: s.host.detach() for s in self.slots if s.bound}

    def host_writes(self, session: "Session", *, refuse: bool = True) -> list[Slot]:
        """Slots written on the host since the last sync, whose values must go to the device
        (copied slots; a bound slot given a new tensor is bound to it instead).

        A tensor converted to another shape or dtype (``model.half()``) cannot go to the
        compiled program: ``refuse`` raises, else the slot is left out (a read of the
        module must not fail; the next run does)."""
        changed = []
        for slot in self.slots:
            current = slot.current()
            if current is None:
                continue
            # a new tensor object (assignment, load_state_dict(assign=True)) or new data (.data = ...)
            if current is not slot.host or current.data_ptr() != slot.ptr:
                if not _compatible(slot, current, refuse):
                    continue
                self._rebind(session, slot, current)
                if not slot.bound:
                    changed.append(slot)
            elif not slot.bound and _version(current) != slot.version:
                changed.append(slot)
        return changed

    def _rebind(self, session: "Session", slot: Slot, tensor: torch.Tensor) -> None:
        """A new host tensor for ``slot``. Device storage that was the old host tensor gets
        replaced (by the new tensor when it can be bound, else by a private copy): it may
        share the old tensor's version counter, and device writes must never look like
        host writes."""
        bound = False
        if slot.bound:
            bound = _bindable(tensor, slot.var, session.device)
            session.bind_storage(slot.var, tensor if bound else tensor.detach().clone())
        slot.host, slot.bound, slot.ptr = tensor, bound, tensor.data_ptr()
        slot.version = _version(tensor) if bound else -1  # a copied slot holds a host write until pushed
        self.copied = [s for s in self.slots if not s.bound]

    def push(self, session: "Session", slots: Iterable[Slot] | None = None) -> None:
        """Copy host values to the device (``slots``: default every copied slot)."""
        slots = list(self.copied if slots is None else slots)
        if slots:
            session.write_variables_data({s.var: to_numpy(s.host) for s in slots})
        for slot in slots:
            slot.version = _version(slot.host)

    def pull(self, session: "Session", *, keep_host_writes: bool = True) -> None:
        """Copy the device's values into the copied host tensors; tensors written on
        the host since the last sync keep their value (they are pushed next)."""
        changed = self.host_writes(session, refuse=False)
        dirty = {id(s) for s in changed} if keep_host_writes else set()
        slots = [s for s in self.copied if id(s) not in dirty and s.current() is s.host
                 and s.host.data_ptr() == s.ptr]
        if not slots:
            return
        data = session.get_tensors_data([s.var for s in slots])
        with torch.no_grad():
            for slot in slots:
                slot.host.copy_(torch.from_numpy(np.array(data[slot.var])))
                slot.version = _version(slot.host)


def _compatible(slot: Slot, tensor: torch.Tensor, refuse: bool) -> bool:
    """Whether a replacement tensor fits the compiled program's variable (``refuse``:
    raise when it does not)."""
    var = slot.var
    if tuple(tensor.shape) == tuple(var.shape) and tensor.dtype == var.dtype:
        return True
    if refuse:
        raise InvalidArgumentError(
            f"'{slot.name}' of the wrapped module is now {tuple(tensor.shape)} {dtype_name(tensor.dtype)}; "
            f"the compiled program holds it as {tuple(var.shape)} {dtype_name(var.dtype)}",
            where=user_source_line(),
            fix="keep the module's parameters and buffers as they were compiled (e.g. no .half() or .double() "
                "after wrapping), or destroy() the model and wrap the module again to compile for the new ones")
    return False


def _version(t: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place write); -2 for inference
    tensors, which have none (their writes cannot be seen)."""
    return -2 if t.is_inference() else t._version


def _bindable(host: torch.Tensor, var: "Variable", device: torch.device) -> bool:
    return (host.device == device and host.dtype == var.dtype and tuple(host.shape) == tuple(var.shape)
            and host.is_contiguous() and not host.is_inference())


# -- reads of the host module pull newer device weights ----------------------------------------
_SYNCED_CLASSES: dict[type, type] = {}
_SYNCED = "_ipuxl_synced"  # a class attribute: True on the classes made by _synced_class


def install_sync_hooks(model: torch.nn.Module, target: SyncTarget) -> None:
    """Make every submodule pull newer device weights (``target.pull_weights_if_newer``)
    before its tensors are read.

    Modules hold their targets weakly: a dropped wrapper is released."""
    for module in torch.nn.Module.modules(model):
        cls = type(module)
        if not getattr(cls, _SYNCED, False):
            module.__class__ = _synced_class(cls)
        targets = module.__dict__.get(_EXECUTORS)
        if targets is None:
            targets = module.__dict__[_EXECUTORS] = weakref.WeakSet()
        targets.add(target)


def remove_sync_hooks(model: torch.nn.Module, target: SyncTarget) -> None:
    """Undo ``install_sync_hooks`` for ``target`` (the module classes stay synced: harmless)."""
    for module in torch.nn.Module.modules(model):
        module.__dict__.get(_EXECUTORS, weakref.WeakSet()).discard(target)


def _pull(module: torch.nn.Module) -> None:
    targets = module.__dict__.get(_EXECUTORS)
    if targets:
        for target in list(targets):
            target.pull_weights_if_newer()


def _synced_class(cls: type) -> type:
    if cls in _SYNCED_CLASSES:
        return _SYNCED_CLASSES[cls]

    def __getattr__(self, name):  # noqa: N807
        if name in self.__dict__.get("_parameters", {}) or name in self.__dict__.get("_buffers", {}):
            _pull(self)
        return cls.__getattr__(self, name)

    def pulling(method: Callable) -> Callable:
        def wrapper(self, *args, **kwargs):
            _pull(self)
            return method(self, *args, **kwargs)

        wrapper.__name__ = method.__name__
        return wrapper

    def __reduce_ex__(self, protocol):  # noqa: N807 - pickle/deepcopy as the user's own class
        _pull(self)
        state = dict(self.__dict__)
        state.pop(_EXECUTORS, None)
        # rebuilt by the standard library alone (``object.__new__(cls)``, then the state):
        # loading never needs ipuxl
        return object.__new__, (cls,), state

    synced = type(cls.__name__, (cls,), {
        "__getattr__": __getattr__, "__reduce_ex__": __reduce_ex__, _SYNCED: True,
        **{name: pulling(getattr(cls, name)) for name in ("named_parameters", "named_buffers", "state_dict", "_apply")},
        "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    _SYNCED_CLASSES[cls] = synced
    return synced


# -- the torch optimiser's state ---------------------------------------------------------------
def install_optimizer_hooks(optimizer: torch.optim.Optimizer, target: SyncTarget) -> list[Any]:
    """``optimizer.state_dict()`` reads the device's optimiser state first
    (``target.pull_state_if_newer``); ``optimizer.load_state_dict()`` sends the loaded
    state before the next run (``target.optimizer_loaded``). ``target`` is held weakly.
    Returns the hook handles (``handle.remove()`` undoes them)."""
    ref = weakref.ref(target)

    def before_state_dict(opt: torch.optim.Optimizer) -> None:
        live = ref()
        if live is not None:
            live.pull_state_if_newer()

    def after_load(opt: torch.optim.Optimizer) -> None:
        live = ref()
        if live is not None:
            live.optimizer_loaded()

    return [optimizer.register_state_dict_pre_hook(before_state_dict),
            optimizer.register_load_state_dict_post_hook(after_load)]
