"""The argument checks and helpers PopTorch's ops share (``ipuxl.poptorch_compat.ops``)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ipuxl.capture.grad_mode import REACHES
from ipuxl.capture.mode import active_mode
from ipuxl.errors import OpArgumentError
from ipuxl.ir.context import user_source_line

__all__ = ["Tensors", "bad_arg", "check_tensor", "as_list", "spec_of", "differentiated"]


Tensors = list[torch.Tensor]


def bad_arg(what: str, fix: str) -> OpArgumentError:
    """The error for a bad argument of an op, located at the user's line."""
    return OpArgumentError(what, where=user_source_line(), fix=fix)


def check_tensor(value: Any, what: str) -> None:
    """Refuse ``value`` unless it is a tensor (``what`` starts the message, as upstream's)."""
    if not isinstance(value, torch.Tensor):
        raise bad_arg(f"{what} {type(value)} is not supported.", "pass a torch.Tensor")


def as_list(outputs: Any) -> list[Any]:
    """A callable's result as a list of outputs (one output: a list of one)."""
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def spec_of(t: Any) -> str:
    """A tensor's shape and dtype (another value's type name), for messages."""
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def differentiated(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a training trace differentiates through one of ``tensors`` (a trained
    parameter's gradient would reach it, see ``capture.grad_mode``)."""
    mode = active_mode()
    grads = mode.grads if mode is not None else None
    return grads is not None and any(grads.flags(t) & REACHES for t in tensors)
