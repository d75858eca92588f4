"""Eager autograd semantics inside a traced ``forward``.

A module is captured by running its ``forward`` on make_fx's functional tensors,
which never require grad, and ``transforms.autodiff`` later differentiates the
whole graph. Left alone, that would differentiate through ``torch.no_grad()``
blocks and ignore ``requires_grad_(False)`` (which functorch refuses outright).
``GradTracker`` restores eager PyTorch's rules while tracing:

1. It tracks, per traced tensor (by identity), what eager autograd would know:
   *requires* (the tensor requires grad), *reaches* (in the graph, a path from a
   trained parameter reaches it without a ``detach``) and *non-leaf* (it requires
   grad because an op made it). Trainable float parameters start as requires +
   reaches; inputs, buffers and the seed as neither.
2. Before each op, an argument that reaches but would not carry a gradient in
   eager (grad mode off, or it stopped requiring grad) is passed through
   ``detach``: the graph then has no path for autodiff there, as eager autograd
   records none. The tensor an in-place op writes keeps its own state.
3. After the op, its results require grad (and are non-leaf) when grad mode is on
   and an argument requires grad; they reach when an argument that was not
   detached reaches. An in-place op updates the state of the tensor it writes.
4. ``Tensor.requires_grad_``, ``detach_``, and the ``requires_grad`` / ``is_leaf``
   properties answer from this state, with eager's error for
   ``requires_grad_(False)`` on a non-leaf.

So ``torch.no_grad()``, ``torch.enable_grad()``, ``torch.inference_mode()``,
``torch.set_grad_enabled()`` and ``requires_grad_`` behave as in eager; a trained
parameter used only under ``no_grad`` gets no gradient (``poptorch_compat.compile.differentiate``
does not cross ``detach``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["GradTracker", "NOT_HANDLED", "is_inplace"]

REQUIRES, REACHES, NONLEAF = 1, 2, 4
NOT_HANDLED = object()
_REQUIRES_GRAD = torch.Tensor.requires_grad
_IS_LEAF = torch.Tensor.is_leaf
_DATA = torch.Tensor.data
_DETACHES = (torch.Tensor.detach, torch.detach)
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__"})
_NONLEAF_MESSAGE = ("you can only change requires_grad flags of leaf variables. If you want to use a computed "
                    "variable in a subgraph that doesn't require differentiation use var_no_grad = var.detach().")


def is_inplace(func: Callable) -> bool:
    """Whether the torch function ``func`` writes its first argument (``add_``, ``__iadd__``...)."""
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


class GradTracker:
    """See the module docstring.

    Args:
        trainable: the traced parameters that require grad.
        differentiated: whether the graph will be differentiated (training); if not,
            nothing needs detaching and only the autograd API is answered.
    """

    def __init__(self, trainable: list[torch.Tensor], differentiated: bool = True):
        self.differentiated = differentiated
        self.state: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in trainable:
            self.state[t] = REQUIRES | (REACHES if differentiated else 0)

    def flags(self, t: torch.Tensor) -> int:
        return self.state.get(t, 0)

    # -- step 4: the autograd API on traced tensors ------------------------------------------
    def intercept(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """The result of an autograd-API call answered from the tracked state, or NOT_HANDLED."""
        if getattr(func, "__name__", "") == "__get__":
            owner = getattr(func, "__self__", None)
            if owner is _REQUIRES_GRAD:
                return bool(self.flags(args[0]) & REQUIRES)
            if owner is _IS_LEAF:
                return not self.flags(args[0]) & NONLEAF
            if owner is _DATA:  # x.data: the same values, no gradient (cut at its next use)
                out = func(*args, **kwargs)
                if self.flags(args[0]) & REACHES:
                    self.state[out] = REACHES
                return out
            return NOT_HANDLED
        if func is torch.Tensor.requires_grad_:
            return self._requires_grad_(*args, **kwargs)
        if func is torch.Tensor.detach_:
            t = args[0]
            self.state[t] = self.flags(t) & REACHES  # later uses are detached (step 2)
            return t
        return NOT_HANDLED

    def _requires_grad_(self, t: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
        flags = self.flags(t)
        if not requires_grad and flags & NONLEAF:
            raise RuntimeError(_NONLEAF_MESSAGE)
        if requires_grad and not (t.is_floating_point() or t.is_complex()):
            raise RuntimeError("only Tensors of floating point and complex dtype can require gradients")
        self.state[t] = (flags | REQUIRES) if requires_grad else (flags & ~REQUIRES)
        return t

    # -- steps 2 and 3: ordinary ops -------------------------------------------------------
    def prepare(self, func: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The op's arguments with the tensors eager autograd would not differentiate detached."""
        grad_on = torch.is_grad_enabled()
        written = args[0] if args and is_inplace(func) else None

        def cut(value: Any) -> bool:
            if not isinstance(value, torch.Tensor) or value is written:
                return False
            flags = self.flags(value)
            return bool(flags & REACHES) and not (grad_on and flags & REQUIRES)

        leaves = pytree.tree_leaves((args, kwargs))
        if not any(cut(v) for v in leaves):
            return args, kwargs
        return pytree.tree_map(lambda v: v.detach() if cut(v) else v, (args, kwargs))

    def record(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        """Set the state of the op's results (and of the tensor an in-place op writes)."""
        tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        if func in _DETACHES:
            return  # results start with no state
        combined = 0
        for t in tensors:
            combined |= self.flags(t)
        if not combined:
            return
        grad_on = torch.is_grad_enabled()
        requires = bool(grad_on and combined & REQUIRES)
        new = (REQUIRES | NONLEAF if requires else 0) | (combined & REACHES)
        if args and is_inplace(func) and isinstance(args[0], torch.Tensor):
            written = args[0]
            if requires:
                self.state[written] = self.flags(written) | new
            return
        for value in pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor) and new:
                self.state[value] = new
