"""Gradient hooks (``Tensor.register_hook``) in a captured program: the hook transforms the
gradient of its tensor, as eager autograd runs it.

A capture records each hook as an ``ipuxl::grad_hook(key, x)`` marker (a hook a parameter
carries, or one a forward registers on a tensor); ``route_grad_hooks`` then puts
``grad_hook_call(key, x)`` between ``x`` and every op that reads it, one per hook (the first
registered runs first in the backward, as eagerly), and drops the markers. Forward, the call is
a view of ``x``; differentiated (autodiff traces under ``torch.func.vjp``), ``_HookVJP``'s
backward calls the hook on the gradient, whatever every reader of ``x`` sent back, and a
result other than None replaces it. The hook itself is traced: it must be made of torch ops.

Each hook lives in the meta of its node (``HOOK``), found by key while a graph holds it;
until its capture routes it, in this thread's pending hooks (a failed capture leaves its few
there).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

from ipuxl.errors import AutodiffError
from ipuxl.ir.context import traceback_source_line

__all__ = ["Hook", "new_hook", "route_grad_hooks", "grad_hook_call", "HOOK"]

HOOK = "ipuxl_grad_hook"
_HOOKS: weakref.WeakValueDictionary[int, Hook] = weakref.WeakValueDictionary()
_KEYS = itertools.count()
_thread = threading.local()  # .pending: this thread's hooks not routed yet (held strongly)


@dataclass(eq=False)
class Hook:
    """One registered hook: the function, the user's line that registered it, whether it was
    removed (its handle's ``remove()`` before the backward: it does not run, as eagerly)."""

    key: int
    fn: Callable[[torch.Tensor], torch.Tensor | None]
    where: str | None
    removed: bool = False

    def remove(self) -> None:
        self.removed = True


def new_hook(fn: Callable[[torch.Tensor], torch.Tensor | None], where: str | None) -> Hook:
    """A record for ``fn``, held until a capture routes it (``route_grad_hooks``)."""
    hook = Hook(next(_KEYS), fn, where)
    _HOOKS[hook.key] = _pending()[hook.key] = hook
    return hook


def _pending() -> dict[int, Hook]:
    pending: dict[int, Hook] = _thread.__dict__.setdefault("pending", {})
    return pending


def route_grad_hooks(gm: GraphModule) -> None:
    """Replace ``gm``'s ``ipuxl::grad_hook`` markers by ``grad_hook_call`` nodes that every reader
    of the hooked value reads through (in place)."""
    markers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.ipuxl.grad_hook.default]
    if not markers:
        return
    hooked: dict[Node, list[Hook]] = {}
    for marker in markers:
        key, value = marker.args
        hook = _pending().pop(key, None) or _HOOKS[key]
        if not hook.removed:
            hooked.setdefault(value, []).append(hook)
        gm.graph.erase_node(marker)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for value, hooks in hooked.items():
        readers = list(value.users)
        at = placeholders[-1] if value.op == "placeholder" else value
        last = value
        for hook in reversed(hooks):  # the backward meets the outermost call first: the first hook
            with gm.graph.inserting_after(at):
                last = gm.graph.call_function(grad_hook_call, (hook.key, last))
            last.meta.update({"val": value.meta.get("val"), HOOK: hook})
            at = last
        for reader in readers:
            reader.replace_input_with(value, last)
    gm.recompile()


def grad_hook_call(key: int, x: torch.Tensor) -> torch.Tensor:
    """``x`` (a view); differentiated, its gradient passes through the hook ``key``."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _HookVJP.apply(key, x)
    return x.view_as(x)


class _HookVJP(torch.autograd.Function):
    @staticmethod
    def forward(key: int, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.key = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        hook = _HOOKS[ctx.key]
        try:
            result = hook.fn(grad)
        except Exception as exc:  # noqa: BLE001 - the user's hook, traced on values not known
            raise AutodiffError(f"the gradient hook {_name(hook.fn)} failed while ipuxl traced it: "
                                f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}",
                                where=traceback_source_line(exc.__traceback__) or hook.where,
                                fix="write the hook with torch ops on the gradient (no Python decisions on its "
                                    "values, no .item())") from exc
        if result is None:
            return None, grad
        if not isinstance(result, torch.Tensor) or result.shape != grad.shape or result.dtype != grad.dtype:
            got = (f"shape {tuple(result.shape)}, {result.dtype}" if isinstance(result, torch.Tensor)
                   else type(result).__name__)
            raise AutodiffError(f"hook {_name(hook.fn)} has changed the size or type of value: it returned {got} for "
                                f"a gradient of shape {tuple(grad.shape)}, {grad.dtype}", where=hook.where,
                                fix="return None or a tensor of the gradient's shape and dtype (eager raises too)")
        return None, result


def _name(fn: Callable[..., Any]) -> str:
    return f"'{getattr(fn, '__qualname__', None) or getattr(fn, '__name__', repr(fn))}'"


_lib = torch.library.Library("ipuxl", "FRAGMENT")
_lib.define("grad_hook(int key, Tensor x) -> Tensor")
_lib.impl("grad_hook", lambda key, x: x.clone(), "CompositeExplicitAutograd")  # a marker: routed before it runs
torch.library.register_fake("ipuxl::grad_hook", lambda key, x: torch.empty_like(x), lib=_lib)
