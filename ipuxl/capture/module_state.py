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
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["call_with_state"]


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


def call_with_state(module: torch.nn.Module, state: dict[str, Any], args: tuple, kwargs: dict) -> Any:
    """``module(*args, **kwargs)`` with the tensors ``state`` names (by the names
    ``named_parameters()`` / ``named_buffers()`` give) replaced by its values, everywhere
    the module holds them; the module's own tensors are back afterwards, whatever happens."""
    own = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    replacement = {id(own[name]): value for name, value in state.items() if name in own}
    by_slot = {name: replacement[id(tensor)] for name, tensor in _slots(module).values()
               if id(tensor) in replacement}
    return torch.func.functional_call(module, by_slot, args, kwargs, tie_weights=False, strict=False)
