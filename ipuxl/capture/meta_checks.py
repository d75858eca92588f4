"""torch's shape checks that pass an ``int`` where ``torch._check`` wants a ``bool``.

Some of torch's meta kernels, which a capture runs to learn output shapes, give
``torch._check`` a condition such as ``input.numel() != 0 or prod(input.shape[1:])``: an
``int`` when the input is empty, which ``torch._check`` refuses with "cond must be a bool"
(``F.interpolate`` on a batch of 0 samples: eager gives an empty result). While a capture
runs, ``int_conditions`` gives ``torch._check`` such a condition as the ``bool`` it means
(its truth value), as eager's C++ check reads it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ipuxl.capture.patches import CapturePatch

__all__ = ["int_conditions"]

_CHECK: Callable[..., None] = torch._check


def _check(cond: Any, message: Any = None) -> None:
    if _PATCH.active() and type(cond) is int:
        cond = bool(cond)
    _CHECK(cond, message)


_PATCH = CapturePatch.replacing(torch, "_check", _check)


def int_conditions() -> contextlib.AbstractContextManager[None]:
    """While inside, ``torch._check`` in this thread takes an ``int`` condition as its truth value."""
    return _PATCH()
