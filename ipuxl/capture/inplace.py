"""In-place torch functions that functionalize refuses, run as the in-place ops they stand for.

torch implements some in-place functions as composites of another in-place op:
``Tensor.clip_`` is ``clamp_``, ``multiply_`` is ``mul_``, ``square_`` is ``pow_(2)``,
``torch.selu_`` (``nn.SELU(inplace=True)``) is ``elu_`` with SELU's constants,
``F.relu6(..., inplace=True)`` is ``hardtanh_(0, 6)``... ``torch.func.functionalize``
refuses these composites ("custom (non-ATen) operator whose output has alias
annotations"), so while a module is captured each runs as the op it stands for
(``REPLACEMENTS``): the kernel, values and errors of eager torch.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["REPLACEMENTS"]

# torch's SELU constants (aten's SELU_ALPHA and SELU_SCALE)
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946

# in-place aliases and the native in-place op each one calls
_RENAMED = {
    "absolute_": "abs_", "arccos_": "acos_", "arccosh_": "acosh_", "arcsin_": "asin_", "arcsinh_": "asinh_",
    "arctan_": "atan_", "arctan2_": "atan2_", "arctanh_": "atanh_", "clip_": "clamp_", "divide_": "div_",
    "true_divide_": "div_", "fix_": "trunc_", "greater_": "gt_", "greater_equal_": "ge_", "less_": "lt_",
    "less_equal_": "le_", "multiply_": "mul_", "negative_": "neg_", "not_equal_": "ne_", "subtract_": "sub_",
}


def _square_(input: torch.Tensor) -> torch.Tensor:
    return input.pow_(2)


def _selu_(input: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.elu_.default(input, _SELU_ALPHA, _SELU_SCALE, 1.0)


def _selu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return _selu_(input) if inplace else torch.selu(input)


def _relu6(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return F.hardtanh(input, 0.0, 6.0, inplace)


#: each torch function that functionalize refuses, and what a capture calls instead
REPLACEMENTS: dict[Callable[..., Any], Callable[..., Any]] = {
    **{getattr(owner, alias): getattr(torch.Tensor, op)
       for alias, op in _RENAMED.items() for owner in (torch.Tensor, torch) if hasattr(owner, alias)},
    torch.Tensor.square_: _square_,
    torch.square_: _square_,
    torch.selu_: _selu_,
    F.selu: _selu,
    F.relu6: _relu6,
}
