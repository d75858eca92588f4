"""Element-wise ops, with numpy broadcasting as in PopXL."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ipuxl.errors import InvalidValueError
from ipuxl.ir.build import check_same_shape, emit
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import elementwise as kernels
from ipuxl.kernels import unsigned

__all__ = [
    "add", "sub", "mul", "div", "negate", "pow", "abs", "exp", "log", "sqrt", "tanh",
    "sigmoid", "relu", "gelu", "swish", "sin", "cos", "ceil", "floor", "sign", "fmod",
    "equal", "greater", "less", "logical_and", "logical_or", "logical_not", "where",
    "maximum", "minimum", "clip", "clamp", "isnan", "isinf", "isfinite", "scaled_add", "scaled_add_", "add_",
    "exp_", "relu_", "gelu_", "swish_", "geluerf", "geluerf_", "log2", "increment_mod", "increment_mod_",
]


def _binary(op_name: str, fn: Any, lhs: Any, rhs: Any) -> Tensor:
    return emit(op_name, fn, (lhs, rhs))


def _unsigned(*values: Any) -> bool:
    """True when a tensor operand is uint16/uint32 (torch's CPU kernels lack their arithmetic)."""
    return any(isinstance(v, Tensor) and unsigned.is_widened(v.spec.dtype) for v in values)


def add(lhs: Any, rhs: Any) -> Tensor:
    """``lhs + rhs`` with broadcasting (unsigned integers wrap around)."""
    return _binary("add", unsigned.add if _unsigned(lhs, rhs) else torch.add, lhs, rhs)


def add_(lhs: Tensor, rhs: Any) -> Tensor:
    """In-place ``lhs += rhs``; returns ``lhs`` modified."""
    kernel = unsigned.add_ if _unsigned(lhs, rhs) else torch.Tensor.add_
    return emit("add_", kernel, (lhs, rhs), modifies=lhs)


def sub(lhs: Any, rhs: Any) -> Tensor:
    """``lhs - rhs`` with broadcasting (unsigned integers wrap around)."""
    return _binary("sub", unsigned.sub if _unsigned(lhs, rhs) else torch.sub, lhs, rhs)


def mul(lhs: Any, rhs: Any) -> Tensor:
    """``lhs * rhs`` with broadcasting."""
    return _binary("mul", torch.mul, lhs, rhs)


def _is_integral(value: Any) -> bool:
    if isinstance(value, Tensor):
        return not value.dtype.is_floating_point
    return isinstance(value, int) and not isinstance(value, bool)


def div(lhs: Any, rhs: Any) -> Tensor:
    """``lhs / rhs`` (integer tensors divide with truncation, as in PopXL).

    A Python ``int`` with an integer tensor is an integer operand too (PopXL makes it
    a constant of the tensor's dtype), so ``int_tensor / 2`` truncates.
    """
    if _is_integral(lhs) and _is_integral(rhs):
        return emit("div", torch.div, (lhs, rhs), {"rounding_mode": "trunc"})
    return _binary("div", torch.div, lhs, rhs)


def fmod(lhs: Any, rhs: Any) -> Tensor:
    """Remainder with the sign of ``lhs``."""
    return _binary("fmod", unsigned.fmod if _unsigned(lhs, rhs) else torch.fmod, lhs, rhs)


def pow(t: Any, e: Any) -> Tensor:  # noqa: A001 - PopXL's public name
    """``t ** e`` with broadcasting."""
    return _binary("pow", torch.pow, t, e)


def maximum(*ts: Any) -> Tensor:
    """Element-wise maximum of several tensors."""
    out = ts[0]
    for t in ts[1:]:
        out = _binary("maximum", torch.maximum, out, t)
    return out


def minimum(*ts: Any) -> Tensor:
    """Element-wise minimum of several tensors."""
    out = ts[0]
    for t in ts[1:]:
        out = _binary("minimum", torch.minimum, out, t)
    return out


def _unary(op_name: str, fn: Any):
    def op(t: Tensor) -> Tensor:
        return emit(op_name, fn, (t,))

    op.__name__ = op.__qualname__ = op_name
    op.__doc__ = f"Element-wise ``{op_name}`` (``{getattr(fn, '__name__', fn)}`` in PyTorch)."
    return op


negate = _unary("negate", torch.neg)
abs = _unary("abs", torch.abs)  # noqa: A001 - PopXL's public name
exp = _unary("exp", torch.exp)
log = _unary("log", torch.log)
sqrt = _unary("sqrt", torch.sqrt)
tanh = _unary("tanh", torch.tanh)
sigmoid = _unary("sigmoid", torch.sigmoid)
relu = _unary("relu", torch.relu)
swish = _unary("swish", F.silu)
sin = _unary("sin", torch.sin)
cos = _unary("cos", torch.cos)
ceil = _unary("ceil", torch.ceil)
floor = _unary("floor", torch.floor)
sign = _unary("sign", torch.sign)
isnan = _unary("isnan", torch.isnan)
isinf = _unary("isinf", torch.isinf)
isfinite = _unary("isfinite", torch.isfinite)
logical_not = _unary("logical_not", torch.logical_not)
log2 = _unary("log2", torch.log2)
geluerf = _unary("geluerf", F.gelu)
geluerf.__doc__ = "Exact GELU, ``x * Phi(x)`` with the error function (PopXL's ``geluerf``)."


def _unary_(op_name: str, kernel: Any):
    def op(t: Tensor) -> Tensor:
        return emit(op_name, kernel, (t,), modifies=t)

    op.__name__ = op.__qualname__ = op_name
    op.__doc__ = f"In-place ``{op_name[:-1]}``: writes the result into ``t`` and returns it."
    return op


exp_ = _unary_("exp_", torch.Tensor.exp_)
relu_ = _unary_("relu_", torch.Tensor.relu_)
gelu_ = _unary_("gelu_", kernels.gelu_)
geluerf_ = _unary_("geluerf_", kernels.geluerf_)
swish_ = _unary_("swish_", kernels.swish_)


def _check_modulus(op_name: str, modulus: float) -> None:
    if modulus == 0:
        raise InvalidValueError(f"op '{op_name}': the modulus must not be 0", where=user_source_line(),
                                   fix="pass a non-zero modulus")


def increment_mod(t: Tensor, increment: float, modulus: float) -> Tensor:
    """``(t + increment) % modulus`` (C ``fmod``: the result has the sign of ``t + increment``),
    in ``t``'s dtype. A wrap-around counter: ``increment_mod(step, 1, n)``."""
    _check_modulus("increment_mod", modulus)
    return emit("increment_mod", kernels.increment_mod, (t, increment, modulus))


def increment_mod_(t: Tensor, increment: float, modulus: float) -> Tensor:
    """In-place ``increment_mod``: writes into ``t`` and returns it."""
    _check_modulus("increment_mod_", modulus)
    return emit("increment_mod_", kernels.increment_mod_, (t, increment, modulus), modifies=t)


def gelu(t: Tensor) -> Tensor:
    """GELU with the tanh approximation (PopXL's ``gelu``; poplibs uses tanh)."""
    return emit("gelu", F.gelu, (t,), {"approximate": "tanh"})


def equal(lhs: Any, rhs: Any) -> Tensor:
    """Element-wise ``lhs == rhs`` (bool)."""
    return _binary("equal", torch.eq, lhs, rhs)


def greater(lhs: Any, rhs: Any) -> Tensor:
    """Element-wise ``lhs > rhs`` (bool)."""
    return _binary("greater", torch.gt, lhs, rhs)


def less(lhs: Any, rhs: Any) -> Tensor:
    """Element-wise ``lhs < rhs`` (bool)."""
    return _binary("less", torch.lt, lhs, rhs)


def logical_and(lhs: Any, rhs: Any) -> Tensor:
    """Element-wise logical and."""
    return _binary("logical_and", torch.logical_and, lhs, rhs)


def logical_or(lhs: Any, rhs: Any) -> Tensor:
    """Element-wise logical or."""
    return _binary("logical_or", torch.logical_or, lhs, rhs)


def where(condition: Tensor, lhs: Any, rhs: Any) -> Tensor:
    """``lhs`` where ``condition`` is true, else ``rhs``."""
    return emit("where", torch.where, (condition, lhs, rhs))


def clip(t: Tensor, min: float | None = float("-inf"), max: float | None = float("inf")) -> Tensor:  # noqa: A002
    """Clamp ``t`` to ``[min, max]`` (NaN propagates); None or an infinite bound is no bound."""
    low = None if min is None or min == float("-inf") else min
    high = None if max is None or max == float("inf") else max
    if low is None and high is None:
        return emit("clip", torch.clone, (t,))
    return emit("clip", torch.clamp, (t, low, high))


clamp = clip


def scaled_add(X: Tensor, Y: Tensor, a: float | Tensor = 1.0, b: float | Tensor = 1.0) -> Tensor:  # noqa: N803
    """``a * X + b * Y`` (``a``, ``b``: Python numbers or scalar tensors)."""
    return emit("scaled_add", kernels.scaled_add, (X, Y, a, b))


def scaled_add_(X: Tensor, Y: Tensor, a: float | Tensor = 1.0, b: float | Tensor = 1.0) -> Tensor:  # noqa: N803
    """In place ``X = a * X + b * Y``; returns ``X`` modified.

    With ``a == 1`` this is one ``Tensor.add_`` call (a Python-number ``b``) or one
    ``Tensor.addcmul_`` (a tensor ``b``, e.g. a learning-rate variable), the forms an
    SGD update takes; both round exactly as eager ``w.add_(g, alpha=-lr)`` does.
    """
    check_same_shape("scaled_add_", X, Y)
    if not (X.dtype.is_floating_point or X.dtype.is_complex):  # torch wants integer factors for integers
        a, b = (int(f) if isinstance(f, float) and f.is_integer() else f for f in (a, b))
    if isinstance(a, (int, float)) and a == 1 and isinstance(b, (int, float)):
        return emit("scaled_add_", torch.Tensor.add_, (X, Y), {"alpha": b}, modifies=X)
    if isinstance(a, (int, float)) and a == 1:
        return emit("scaled_add_", torch.Tensor.addcmul_, (X, Y, b), modifies=X)
    return emit("scaled_add_", kernels.scaled_add_, (X, Y, a, b), modifies=X)
