"""The IPU's floating-point exceptions, checked around each op of a compiled program.

With PopART's ``enableFloatingPointChecks`` (PopTorch's
``Options.Precision.enableFloatingPointExceptions(True)``, or the Poplar engine option
``debug.floatPointOpException``) an IPU stops the program at the first arithmetic that
sets one of Poplar's floating-point exception flags (``poplar::FloatingPointBehaviour``):

* invalid operation: an operation with a Not-a-Number operand, a comparison with one, or
  an operation whose IEEE result is NaN from numbers (``inf - inf``, ``0 * inf``,
  ``0 / 0``, ``sqrt(-1)``, ``log(-1)``);
* division by zero and overflow: an infinity made from finite operands (``1 / 0``,
  ``exp(3800)``, a float16 sum past 65504).

The compiled code checks the same conditions in software: ``operands`` runs before an op
(it raises on a NaN operand and tells whether an operand is infinite) and ``results``
after it (it raises on a NaN result, or an infinite one from finite operands), reading the
tensors the op returns and those it wrote in place. Moving data is not arithmetic:
views, copies, concatenation, gathers, selects and fills (``where``, ``masked_fill``) pass
NaN and infinity through, as on an IPU. A check reads every operand and result on the
host (one ``any()`` each), so a checked program runs slower and is never CUDA-graphed;
it is a debugging option, off by default as upstream.

The error is a ``FloatingPointError``, which the session turns into an
``ApplicationRuntimeError`` (a ``DeviceError`` and ``poptorch.Error``, PopART's
``poplar_application_runtime_error``) that names the op and the user's line that built it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ipuxl.kernels.program_stop import ProgramStop

__all__ = ["FloatingPointException", "operands", "results"]


class FloatingPointException(ProgramStop, FloatingPointError):
    """An op set one of the IPU's floating-point exception flags."""


def operands(label: str, *args: Any) -> bool:
    """Before op ``label``: raise on a NaN operand; else whether an operand is infinite."""
    infinite = False
    for position, tensor in _floating(args):
        if bool(tensor.isnan().any()):
            raise FloatingPointException(
                f"floating-point exception (invalid operation): {label} has Not-a-Number in operand {position} "
                f"({_described(tensor)})")
        infinite = infinite or bool(tensor.isinf().any())
    return infinite


def results(label: str, infinite_operand: bool, result: Any, *written: Any) -> None:
    """After op ``label``: raise on a NaN in what it returned or wrote, or an infinity that
    none of its operands held (``infinite_operand``: what ``operands`` answered)."""
    for _, tensor in _floating((result, *written)):
        if bool(tensor.isnan().any()):
            raise FloatingPointException(
                f"floating-point exception (invalid operation): {label} made Not-a-Number ({_described(tensor)}), "
                "e.g. inf - inf, 0 * inf, 0 / 0 or the square root or logarithm of a negative number")
        if not infinite_operand and bool(tensor.isinf().any()):
            raise FloatingPointException(
                f"floating-point exception (division by zero or overflow): {label} made an infinity from finite "
                f"operands ({_described(tensor)}; the largest finite {_dtype(tensor)} is {torch.finfo(tensor.dtype).max:g})")


def _floating(values: Any) -> list[tuple[int, torch.Tensor]]:
    """The floating-point tensors among ``values`` (nested), numbered from 1."""
    leaves = tree_leaves(values)
    return [(i, t) for i, t in enumerate(leaves, 1)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


def _described(tensor: torch.Tensor) -> str:
    nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
    counts = ", ".join(part for part in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if part)
    return f"a {_dtype(tensor)} tensor of shape {tuple(tensor.shape)}" + (f" holding {counts}" if counts else "")


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
