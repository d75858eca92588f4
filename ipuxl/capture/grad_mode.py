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
5. An in-place op that autograd does not record (grad mode off, or no operand
   requires grad), or any in-place op through a detached alias (``v.detach().clamp_()``,
   ``w.data.mul_()``), changes the values of the tensors sharing the written storage
   but not their gradient paths. Under functionalize the write makes a new value of
   the aliased tensor ``r`` computed from a detached alias, which would cut its
   gradient path, so the tracker keeps the gradient straight through: see the note
   on straight-through writes.

Note [straight-through writes]: before such a write to ``t`` the tracker takes
``ghost = -(r.detach() - r)`` (-0.0; its gradient is the identity to ``r``) for
``r``, the tensor that carries the gradient through ``t``'s storage (``t``'s alias
root: ``t`` itself, or the tensor ``t`` is a detached alias or a view of). After the
write it sets ``r`` to ``r.detach() + ghost``: ``r`` keeps its new values exactly
(``x + -0.0`` is ``x``) and its gradient flows to ``r`` before the write, as eager
autograd, which never saw the write, sends it. Alias roots are tracked through
``detach``, ``.data`` and view ops (``_VIEWS``); ``Gamma.rsample`` relies on this.
Limit: a detached alias that a recorded in-place op made require grad
(``d = v.detach(); d.add_(w)``) is read back from ``r`` afterwards, without its
gradient to ``w``.

So ``torch.no_grad()``, ``torch.enable_grad()``, ``torch.inference_mode()``,
``torch.set_grad_enabled()`` and ``requires_grad_`` behave as in eager; a trained
parameter used only under ``no_grad`` gets no gradient
(``poptorch_compat.compile.compile_model.differentiate`` does not cross ``detach``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["GradTracker", "NOT_HANDLED", "is_inplace", "REQUIRES", "REACHES"]

REQUIRES, REACHES, NONLEAF = 1, 2, 4
NOT_HANDLED = object()
_REQUIRES_GRAD = torch.Tensor.requires_grad
_IS_LEAF = torch.Tensor.is_leaf
_DATA = torch.Tensor.data
_DETACHES = (torch.Tensor.detach, torch.detach)
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__"})
# view ops: their result shares the storage of their first argument (basic ``__getitem__`` too)
_VIEWS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "t", "transpose",
    "permute", "movedim", "moveaxis", "swapaxes", "swapdims", "narrow", "select", "expand", "expand_as", "diagonal",
    "unfold", "as_strided", "split", "chunk", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit", "real", "imag",
    "view_as_real", "view_as_complex", "alias", "contiguous", "adjoint",
})
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
        # alias -> (the tensor whose gradient path its storage carries, whether the link
        # passes through a detach) (step 5)
        self.roots: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._ghost: tuple[torch.Tensor, torch.Tensor] | None = None  # (root, ghost) of the write under way
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
                    self.roots[out] = (self.root(args[0]), True)
                return out
            return NOT_HANDLED
        if func is torch.Tensor.requires_grad_:
            return self._requires_grad_(*args, **kwargs)
        if func is torch.Tensor.detach_:
            t = args[0]
            self.state[t] = self.flags(t) & REACHES  # later uses are detached (step 2)
            return t
        return NOT_HANDLED

    def root(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor whose gradient path ``t``'s storage carries (``t`` itself unless ``t``
        is a detached alias or a view of another tracked tensor)."""
        return self._link(t)[0]

    def _link(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``t``'s alias root, and whether ``t`` reaches it through a detach."""
        link: tuple[torch.Tensor, bool] = self.roots.get(t, (t, False))
        return link

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
        self._ghost = None
        written = args[0] if args and is_inplace(func) and isinstance(args[0], torch.Tensor) else None
        leaves = pytree.tree_leaves((args, kwargs))
        if written is not None and self.differentiated:
            self._take_ghost(written, leaves, grad_on)

        def cut(value: Any) -> bool:
            if not isinstance(value, torch.Tensor) or value is written:
                return False
            flags = self.flags(value)
            return bool(flags & REACHES) and not (grad_on and flags & REQUIRES)

        if not any(cut(v) for v in leaves):
            return args, kwargs
        return pytree.tree_map(lambda v: self._detached(v) if cut(v) else v, (args, kwargs))

    def _detached(self, t: torch.Tensor) -> torch.Tensor:
        """``t.detach()``, an alias of ``t``'s storage."""
        out = t.detach()
        self.roots[out] = (self.root(t), True)
        return out

    def _take_ghost(self, written: torch.Tensor, leaves: list, grad_on: bool) -> None:
        """Before an in-place op on ``written`` that autograd does not record on its alias
        root, keep the root's gradient path (step 5; see the note on straight-through writes)."""
        recorded = grad_on and any(isinstance(v, torch.Tensor) and self.flags(v) & REQUIRES for v in leaves)
        root, through_detach = self._link(written)
        if recorded and not through_detach:
            return
        if not self.flags(root) & REACHES or not (root.is_floating_point() or root.is_complex()):
            return
        # -0.0 (x + -0.0 is x, signed zeros too), 0 where root is not finite; its gradient: the identity
        self._ghost = (root, torch.nan_to_num(root.detach() - root, nan=0.0, posinf=0.0, neginf=0.0).neg())

    def _restore_gradient_path(self) -> None:
        """After the write: ``root`` keeps its new values and its gradient path from before."""
        if self._ghost is None:
            return
        root, ghost = self._ghost
        self._ghost = None
        value = root.detach() + ghost
        root.fill_(-0.0).add_(value)  # root.copy_(value), but aten.copy has no derivative

    def record(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        """Set the state of the op's results (and of the tensor an in-place op writes)."""
        self._restore_gradient_path()
        tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        self._record_aliases(func, args, out)
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

    def _record_aliases(self, func: Callable, args: tuple, out: Any) -> None:
        """Record the alias root of a view's (or ``detach``'s) results."""
        if not args or not isinstance(args[0], torch.Tensor) or not _is_view(func, args):
            return
        root, through_detach = self._link(args[0])
        if not self.flags(root) & REACHES:
            return
        link = (root, through_detach or func in _DETACHES)
        for value in pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor) and value is not root:
                self.roots[value] = link


def _is_view(func: Callable, args: tuple) -> bool:
    """Whether ``func(*args)`` returns views of ``args[0]`` (basic indexing included)."""
    if func in _DETACHES:
        return True
    name = getattr(func, "__name__", "")
    if name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return not any(isinstance(p, (torch.Tensor, list)) for p in parts)
    return name in _VIEWS
