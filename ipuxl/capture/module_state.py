"""Run a module on other values of its parameters and buffers, and give it back intact.

``torch.func.functional_call(module, values, ..., tie_weights=True)`` swaps each name's
tensor in and, afterwards, the original back. A submodule reached by several paths (one
module object held by several parents, as timm's CoaT shares its positional encodings
with its blocks) has one slot per attribute but several names; torch swaps that slot once
per name, records the value it swapped in first as the "original" of the later names, and
restores that: the module keeps the capture's fake or functional tensors, so its weights
are gone and every later call fails. ``call_with_state`` swaps each (module, attribute)
slot exactly once, with every name of a tied tensor (the same tensor held by two modules,
as tied embeddings) given its own slot's value.

A ``forward`` that reassigns a buffer (``self.y = x`` for a buffer ``y``) replaces it in
eager PyTorch; swapped back afterwards, the capture would lose that. ``call_with_state``
looks at each buffer's slot when ``forward`` returns: a reassigned buffer is copied into
(``"copy"``: the program updates the buffer, as eager leaves it holding the new value; its
shape and dtype must stay) or refused with PopTorch's error (``"refuse"``).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Literal

import torch

from ipuxl.errors import TraceError

__all__ = ["call_with_state", "refusing_reassigned_buffers"]

_ACTION: contextvars.ContextVar[Literal["copy", "refuse"]] = contextvars.ContextVar("reassigned_buffers", default="copy")


@contextlib.contextmanager
def refusing_reassigned_buffers() -> Iterator[None]:
    """While inside, a capture refuses a buffer reassigned by ``forward`` with PopTorch's error
    (its contract: ``import poptorch``) instead of copying into it."""
    token = _ACTION.set("refuse")
    try:
        yield
    finally:
        _ACTION.reset(token)


def _slots(module: torch.nn.Module) -> dict[tuple[int, str], tuple[str, torch.Tensor]]:
    """(owner module, attribute) -> (one qualified name of it, its tensor), for every
    parameter and buffer however many paths reach it."""
    slots: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attribute, tensor in [*owner._parameters.items(), *owner._buffers.items()]:
            if tensor is not None:
                name = f"{prefix}.{attribute}" if prefix else attribute
                slots.setdefault((id(owner), attribute), (name, tensor))
    return slots


def call_with_state(module: torch.nn.Module, state: dict[str, Any], args: tuple, kwargs: dict, *,
                    reassigned: Literal["copy", "refuse"] | None = None) -> Any:
    """``module(*args, **kwargs)`` with the tensors ``state`` names (by the names
    ``named_parameters()`` / ``named_buffers()`` give) replaced by its values, everywhere
    the module holds them; the module's own tensors are back afterwards, whatever happens.
    A buffer ``forward`` reassigns is copied into or refused (``reassigned``, by default as
    ``refusing_reassigned_buffers`` says; see the module docstring).

    Raises:
        TraceError: a buffer reassigned with another shape or dtype, or under ``"refuse"``."""
    own = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    replacement = {id(own[name]): value for name, value in state.items() if name in own}
    slots = _slots(module)
    by_slot = {name: replacement[id(tensor)] for name, tensor in slots.values() if id(tensor) in replacement}
    owners = dict(module.named_modules(remove_duplicate=False))
    watched = [(owners[name.rpartition(".")[0]], attribute, name) for (_, attribute), (name, _) in slots.items()
               if name in by_slot and attribute in owners[name.rpartition(".")[0]]._buffers]
    action = reassigned or _ACTION.get()
    hook = module.register_forward_hook(lambda *_: _reassigned(watched, by_slot, action))
    try:
        return torch.func.functional_call(module, by_slot, args, kwargs, tie_weights=False, strict=False)
    finally:
        hook.remove()


def _reassigned(watched: list[tuple[torch.nn.Module, str, str]], by_slot: dict[str, Any],
                action: Literal["copy", "refuse"]) -> None:
    """Copy each buffer ``forward`` reassigned into the value swapped in for it, or refuse it."""
    for owner, attribute, name in watched:
        value, swapped = owner._buffers.get(attribute), by_slot[name]
        if value is swapped or attribute not in owner._buffers:
            continue  # kept, or deleted (refused where the call's buffers are read back)
        if action == "refuse":
            raise TraceError(
                f"Buffer {name} is reassigned within the model when calling the forward method. This is not "
                f"supported. Consider using self.{attribute}.copy_(src) to copy data from a source tensor, where src "
                "is the name of the source tensor.", fix=f"write self.{attribute}.copy_(src) in forward")
        got = (f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        if not isinstance(value, torch.Tensor) or value.shape != swapped.shape or value.dtype != swapped.dtype:
            raise TraceError(
                f"forward reassigns buffer '{name}' ({tuple(swapped.shape)} {swapped.dtype}) with a value of {got}",
                fix=f"keep the buffer's shape and dtype (self.{attribute}.copy_(src)); a compiled program's "
                    "buffers are fixed when it is compiled")
        with torch.no_grad():
            swapped.copy_(value)
