"""Kernels of ``ipuxl.ops.debug``: ``init`` makes a tensor, ``print_tensor`` prints a
tensor (and optionally its gradient) at run time.

The print is PopTorch's ``ipu_print_tensor`` kernel (``kernels.poplar_print``: a torch
custom op, so tracing records it as one node; Poplar's layout, on stderr), with PopXL's
defaults. Its gradient prints through the op's autograd formula; without ``print_self``,
through an ``autograd.Function`` whose backward calls the op on the incoming gradient.
"""
from __future__ import annotations

from typing import Any

import torch

import ipuxl.kernels.poplar_print  # noqa: F401 - defines torch.ops.ipuxl.ipu_print_tensor

__all__ = ["init", "print_tensor"]


def init(shape: list[int], dtype: torch.dtype, zero: bool) -> torch.Tensor:
    """A new tensor of ``shape``: zeros when ``zero``, else uninitialised."""
    return torch.zeros(shape, dtype=dtype) if zero else torch.empty(shape, dtype=dtype)


class _PrintGradient(torch.autograd.Function):
    """Identity whose backward prints the gradient flowing through it (``print_self=False``)."""

    @staticmethod
    def forward(t: torch.Tensor, title: str, fmt: tuple[Any, ...]) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.title, ctx.fmt = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return torch.ops.ipuxl.ipu_print_tensor(grad, f"{ctx.title}_gradient", False, *ctx.fmt), None, None


def print_tensor(t: torch.Tensor, title: str, print_self: bool, print_gradient: bool, *fmt: Any) -> torch.Tensor:
    """``t`` (a copy), printed now when ``print_self``, its gradient printed (titled
    ``"<title>_gradient"``) when ``print_gradient``; ``fmt``: Poplar's print options, in
    ``poplar_print.PrintFormat``'s order."""
    if print_self:
        return torch.ops.ipuxl.ipu_print_tensor(t, title, print_gradient, *fmt)
    return _PrintGradient.apply(t, title, fmt) if print_gradient else t.clone()
