"""Tensors a module's forward reaches from outside its parameters, buffers and inputs.

A closure variable, a plain tensor attribute (not registered as a parameter or
buffer), a tensor held by a lambda or a functional helper: PopTorch makes each a
constant of the program, with its value at compile time. ``OutsideTensors`` does
the same while a module is traced: each such tensor is replaced by a snapshot
(detached, copied once per trace), which make_fx records as a constant of the
graph. So, as in PopTorch:

* later changes to the Python tensor are not seen by the compiled program;
* a constant gets no gradient, even when the tensor requires grad.

An in-place write to such a tensor inside forward is refused: eager PyTorch would
change the user's tensor at every call, a constant cannot.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from ipuxl.capture.grad_mode import is_inplace
from ipuxl.errors import TraceError
from ipuxl.ir.context import user_source_line

__all__ = ["OutsideTensors", "is_outside"]


def is_outside(value: Any) -> bool:
    """A real tensor seen while tracing: not a traced (fake/functional) value, not a meta tensor."""
    return isinstance(value, torch.Tensor) and not is_fake(value) and value.device.type != "meta"


class OutsideTensors:
    """Swaps outside tensors in an op's arguments for their constant snapshots.

    Args:
        to_meta: give meta tensors instead of copies (a dry run on meta tensors).
    """

    def __init__(self, to_meta: bool = False):
        self._to_meta = to_meta
        self._snapshots: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def lift(self, func: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with each outside tensor replaced by its snapshot.

        Raises:
            TraceError: ``func`` writes in place to an outside tensor.
        """
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(is_outside(v) for v in leaves):
            return args, kwargs
        if args and is_inplace(func) and is_outside(args[0]):
            self._refuse_write(func, args[0])
        return pytree.tree_map(lambda v: self._snapshot(v) if is_outside(v) else v, (args, kwargs))

    def _snapshot(self, t: torch.Tensor) -> torch.Tensor:
        if t not in self._snapshots:
            with _disable_current_modes(), torch.no_grad():  # a real copy, made outside the trace
                self._snapshots[t] = (torch.empty_like(t, device="meta") if self._to_meta
                                      else t.detach().clone())
        snapshot: torch.Tensor = self._snapshots[t]
        return snapshot

    @staticmethod
    def _refuse_write(func: Callable, t: torch.Tensor) -> None:
        name = getattr(func, "__name__", str(func))
        raise TraceError(
            f"forward writes in place ({name}) to a tensor of shape {tuple(t.shape)} {t.dtype} that is not a "
            "parameter, buffer or input of the module (a closure variable or plain attribute): ipuxl, like "
            "PopTorch, makes such tensors constants of the program", where=user_source_line(),
            fix="register it as a buffer (self.register_buffer(name, tensor)) so the program can update it, "
                "or write to a copy (t = t.clone())")
