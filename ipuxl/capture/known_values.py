"""Values known while capturing: Python decisions on tensors computed from constants.

A capture runs the forward on fake tensors, so ``bool(t)``, ``t.item()`` or
``torch.equal(a, b)`` has no value to give, and capture stops ("data-dependent").
Some tensors, though, have the same value at every step: those made inside forward
from constants alone (``torch.triu(torch.full((n, n), -inf), 1)``, ``torch.arange(n)``),
and ops on them. Library code decides things from such values: ``nn.Transformer``
compares the causal mask it was given with the one it would build
(``_detect_is_causal_mask``) to take a faster path. Eager PyTorch decides the same way
at every step, so the decision can be taken once, at capture.

``KnownValues`` keeps, beside each such fake tensor, its real value (a *shadow*,
computed on real tensors as the op runs): a result gets one when every tensor it was
computed from has one; factory functions (no tensor operands) give one, except random
ones (their values change each step). A read of a tensor with a shadow (``bool``,
``item``, ``tolist``, ``int``/``float``/``index``, ``torch.equal``, ``is_nonzero``) answers
from it; the program still computes the tensor itself (the graph is unchanged).
An in-place write whose operands are not all known drops the shadow of every tensor
sharing the written one's memory, so a stale value is never read.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from ipuxl.capture.grad_mode import is_inplace

__all__ = ["KnownValues", "NOT_KNOWN"]

NOT_KNOWN = object()  # ``KnownValues.read``: no known answer

# Python-level reads of a tensor's value (each would be data-dependent on a fake tensor)
_READS = frozenset({torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
                    torch.Tensor.__float__, torch.Tensor.__index__, torch.equal, torch.is_nonzero})
# names of random functions: their values change every step, so they are never known
_RANDOM_WORDS = ("rand", "normal", "bernoulli", "multinomial", "poisson", "uniform", "exponential", "geometric",
                 "cauchy", "dropout", "random")


@contextlib.contextmanager
def _real() -> Iterator[None]:
    """Plain eager computation inside a trace: no fake/proxy modes, no functorch wrapping
    (the trace runs under ``torch.func.functionalize``), no autograd."""
    with _disable_current_modes(), torch._C._DisableFuncTorch(), torch.no_grad():
        yield


def _is_random(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    return any(word in name for word in _RANDOM_WORDS)


class KnownValues:
    """The shadows of a capture's fake tensors (see the module docstring)."""

    def __init__(self) -> None:
        self._shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __contains__(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self._shadows

    def read(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """The answer of a value read from known tensors, or ``NOT_KNOWN``."""
        if func not in _READS:
            return NOT_KNOWN
        real = self._real_operands(args, kwargs)
        if real is None:
            return NOT_KNOWN
        with _real():
            return func(*real[0], **real[1])

    def record(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        """Give ``out`` shadows when all of ``func``'s operands are known; forget written memory otherwise."""
        if func in _READS:
            return
        real = self._real_operands(args, kwargs)
        writes = is_inplace(func) or "out" in kwargs
        if real is None or _is_random(func):
            if writes:
                self._forget_written(args[0] if args else kwargs.get("out"))
            return
        try:
            with _real():
                value = func(*real[0], **real[1])
        except Exception:  # noqa: BLE001 - no shadow then: reads fall back to capture's own answer
            if writes:
                self._forget_written(args[0] if args else kwargs.get("out"))
            return
        for fake, shadow in zip(pytree.tree_leaves(out), pytree.tree_leaves(value)):
            if isinstance(fake, torch.Tensor) and isinstance(shadow, torch.Tensor) and fake.shape == shadow.shape:
                self._shadows[fake] = shadow

    def _real_operands(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``(args, kwargs)`` with every tensor replaced by its shadow; None if one has none."""
        tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        if any(t not in self._shadows for t in tensors):
            return None
        return pytree.tree_map(lambda v: self._shadows[v] if isinstance(v, torch.Tensor) else v, (args, kwargs))

    def _forget_written(self, target: Any) -> None:
        """Drop the shadows of ``target`` and of every tensor sharing its shadow's memory."""
        if not isinstance(target, torch.Tensor) or target not in self._shadows:
            return
        storage = self._shadows[target].untyped_storage().data_ptr()
        stale = [t for t, s in self._shadows.items() if s.untyped_storage().data_ptr() == storage]
        for t in stale:
            del self._shadows[t]
