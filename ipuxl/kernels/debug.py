"""Kernels of ``ipuxl.ops.debug``: ``init`` makes a tensor, ``print_tensor`` prints a
tensor (and optionally its gradient) at run time.

The print is a torch custom op (``ipuxl::print_tensor``), so tracing (autodiff's
``make_fx``) records it as one node instead of printing fake tensors while tracing.
Its gradient print is an ``autograd.Function`` whose backward calls the same op on
the incoming gradient, so the grad graph prints it when it runs.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["init", "print_tensor", "format_tensor"]


def init(shape: list[int], dtype: torch.dtype, zero: bool) -> torch.Tensor:
    """A new tensor of ``shape``: zeros when ``zero``, else uninitialised."""
    return torch.zeros(shape, dtype=dtype) if zero else torch.empty(shape, dtype=dtype)


def format_tensor(title: str, t: torch.Tensor) -> str:
    """The printed line: ``title: value`` with the tensor's values, shape and dtype."""
    return f"{title}: {t.detach().cpu().tolist()} (shape {tuple(t.shape)}, {t.dtype})"


@torch.library.custom_op("ipuxl::print_tensor", mutates_args=())
def _print(t: torch.Tensor, title: str) -> torch.Tensor:
    print(format_tensor(title, t), flush=True)
    return t.clone()


@_print.register_fake
def _(t: torch.Tensor, title: str) -> torch.Tensor:
    return torch.empty_like(t)


class _PrintGradient(torch.autograd.Function):
    """Identity whose backward prints the gradient flowing through it."""

    @staticmethod
    def forward(t: torch.Tensor, title: str) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.title = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.ops.ipuxl.print_tensor(grad, f"{ctx.title} gradient"), None


def print_tensor(t: torch.Tensor, title: str, print_self: bool, print_gradient: bool) -> torch.Tensor:
    """``t`` (a copy), printed now when ``print_self``, its gradient printed when ``print_gradient``."""
    out = torch.ops.ipuxl.print_tensor(t, title) if print_self else t.clone()
    return _PrintGradient.apply(out, title) if print_gradient else out
