"""Host callbacks: Python functions that the device program calls while it runs.

``torch.ops.ipuxl.host_callback(inputs, handle)`` is a torch custom op, so a trace
records it as one node and the device calls the registered Python function each time
the program runs (PopTorch's ``poptorch.CPU`` ops). The function is registered with
the shapes and dtypes of its outputs (``register``); the op's fake kernel answers
from them, so tracing never calls the function.

The registry holds callbacks weakly: a callback whose owner is gone raises at run
time instead of keeping the owner alive.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Callback", "register", "OutputSpec"]

OutputSpec = tuple[tuple[int, ...], torch.dtype]


@dataclass
class Callback:
    """A host function and the outputs it promises: ``name`` is the user's ID."""

    fn: Callable[..., Any]
    name: str
    outputs: list[OutputSpec]


_registry: weakref.WeakValueDictionary[int, Callback] = weakref.WeakValueDictionary()
_handles = itertools.count(1)
_lock = threading.Lock()


def register(callback: Callback) -> int:
    """Register ``callback`` (held weakly: keep a reference) and return its handle."""
    with _lock:
        handle = next(_handles)
        _registry[handle] = callback
    return handle


def _lookup(handle: int) -> Callback:
    callback = _registry.get(handle)
    if callback is None:
        raise RuntimeError(f"host callback {handle} no longer exists: the poptorch.CPU op that registered it "
                           "was deleted; keep it alive (as a module attribute) while the model runs")
    return callback


def _checked(callback: Callback, outs: Any) -> list[torch.Tensor]:
    """The callback's outputs as a list of new tensors, checked against what it promised."""
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    got = [(tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else type(o).__name__ for o in outs]
    if got != callback.outputs:
        raise RuntimeError(f"CPU op '{callback.name}' returned {got} at run time, but {callback.outputs} "
                           "(shapes, dtypes) when the model was compiled; a CPU op must return the same "
                           "shapes and dtypes every time")
    return [o.detach().clone() for o in outs]


@torch.library.custom_op("ipuxl::host_callback", mutates_args=())
def _host_callback(inputs: list[torch.Tensor], handle: int) -> list[torch.Tensor]:
    callback = _lookup(handle)
    with torch.no_grad():
        return _checked(callback, callback.fn(*[x.detach() for x in inputs]))


@_host_callback.register_fake
def _(inputs: list[torch.Tensor], handle: int) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype) for shape, dtype in _lookup(handle).outputs]
