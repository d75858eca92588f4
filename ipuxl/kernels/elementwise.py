"""Element-wise kernels of ``ipuxl.ops.elementwise``: the in-place activations, the
wrap-around counter and the scaled additions.

Functions ending in ``_`` write into their first argument and return it. The device's
rewrites match ``scaled_add_`` (a momentum update ``buf = m * buf + g`` is one) and
replace it, with the weight update that follows, by the fused kernels of
``ipuxl.kernels.var_updates``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ipuxl.kernels import unsigned

__all__ = ["gelu_", "geluerf_", "swish_", "increment_mod", "increment_mod_", "scaled_add", "scaled_add_"]


# The activation reads a copy of ``t``: autograd saves its input, which copy_ then overwrites.
def gelu_(t: torch.Tensor) -> torch.Tensor:
    """In-place GELU with the tanh approximation."""
    return t.copy_(F.gelu(t.clone(), approximate="tanh"))


def geluerf_(t: torch.Tensor) -> torch.Tensor:
    """In-place exact GELU (with the error function)."""
    return t.copy_(F.gelu(t.clone()))


def swish_(t: torch.Tensor) -> torch.Tensor:
    """In-place swish (SiLU)."""
    return t.copy_(F.silu(t.clone()))


def increment_mod(t: torch.Tensor, increment: float, modulus: float) -> torch.Tensor:
    """``fmod(t + increment, modulus)`` in ``t``'s dtype (unsigned integers wrap around)."""
    if unsigned.is_widened(t.dtype):
        return unsigned.fmod(unsigned.add(t, increment), modulus)
    return torch.fmod(t + increment, modulus).to(t.dtype)


def increment_mod_(t: torch.Tensor, increment: float, modulus: float) -> torch.Tensor:
    """In-place ``increment_mod``."""
    return t.copy_(increment_mod(t, increment, modulus))


def scaled_add(x: torch.Tensor, y: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
    """``a * x + b * y``."""
    return x * a + y * b


def scaled_add_(x: torch.Tensor, y: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
    """In place ``x = a * x + b * y``: the kernel of ``ops.scaled_add_`` with ``a != 1``
    (``a == 1`` is a plain ``add_``/``addcmul_``)."""
    if not (isinstance(a, (int, float)) and a == 1):
        x.mul_(a)
    if isinstance(b, (int, float)):
        return x.add_(y, alpha=b)
    return x.addcmul_(y, b)  # one pass, rounded as x.add_(y, alpha=b) would be
