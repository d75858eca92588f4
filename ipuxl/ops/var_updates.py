"""In-place variable updates (PopXL's ``ops.var_updates``).

Every ``*_`` op writes into its first argument and returns it. Factors may be Python
numbers (baked into the program) or scalar tensors (changeable at run time). As in
PopXL, ``t`` and ``X`` must have one shape (no broadcasting); ``X`` may have another
dtype and is converted to ``t``'s before any arithmetic.
"""
from __future__ import annotations

from typing import Any

import torch

from ipuxl.ir.build import check_same_shape, emit
from ipuxl.errors import InvalidArgumentError, InvalidValueError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import var_updates as kernels
from ipuxl.ops.reduce import lamb_square

__all__ = [
    "accumulate_", "accumulate_square_", "accumulate_mean_", "accumulate_moving_average_",
    "accumulate_moving_average_square_", "accumulator_scale_", "accumulator_zero_",
    "copy_var_update_", "sparse_accumulate_", "adam_updater", "lamb_updater", "adamax_updater", "adam_var_update",
    "lamb_square",
]

Factor = float | Tensor


def _update(op_name: str, kernel: Any, t: Tensor, X: Tensor, f: Any) -> Tensor:  # noqa: N803
    check_same_shape(op_name, t, X)
    return emit(op_name, kernel, (t, X, f), modifies=t, name=f"{op_name}_{t.name}")


def accumulate_(t: Tensor, X: Tensor, f: Factor | None = None) -> Tensor:  # noqa: N803
    """``t += X`` when ``f`` is None, else ``t += f * X``."""
    return _update("accumulate_", kernels.accumulate_, t, X, f)


def accumulate_square_(t: Tensor, X: Tensor, f: Factor = 1.0) -> Tensor:  # noqa: N803
    """``t += f * X**2``."""
    return _update("accumulate_square_", kernels.accumulate_square_, t, X, f)


def accumulate_mean_(t: Tensor, X: Tensor, step: Factor) -> Tensor:  # noqa: N803
    """Running mean: ``t = step/(step+1) * t + X/(step+1)`` (``step`` values seen before)."""
    return _update("accumulate_mean_", kernels.running_mean_, t, X, step)


def accumulate_moving_average_(t: Tensor, X: Tensor, f: Factor) -> Tensor:  # noqa: N803
    """``t = f * t + (1 - f) * X``."""
    return _update("accumulate_moving_average_", kernels.moving_average_, t, X, f)


def accumulate_moving_average_square_(t: Tensor, X: Tensor, f: Factor) -> Tensor:  # noqa: N803
    """``t = f * t + (1 - f) * X**2``."""
    return _update("accumulate_moving_average_square_", kernels.moving_average_square_, t, X, f)


def accumulator_scale_(t: Tensor, f: Factor) -> Tensor:
    """``t = f * t`` (``f == 0`` zeroes ``t``)."""
    return emit("accumulator_scale_", kernels.scale_, (t, f), modifies=t)


def accumulator_zero_(t: Tensor) -> Tensor:
    """``t = 0``."""
    return accumulator_scale_(t, 0.0)


def copy_var_update_(t: Tensor, X: Tensor) -> Tensor:  # noqa: N803
    """``t[...] = X``."""
    check_same_shape("copy_var_update_", t, X)
    return emit("copy_var_update_", torch.Tensor.copy_, (t, X), modifies=t, name=f"updated_{t.name}")


def sparse_accumulate_(t: Tensor, X: Tensor, indices: Tensor, axis: int = 0, f: Factor | None = None,  # noqa: N803
                       W: Tensor | None = None) -> Tensor:  # noqa: N803
    """Add slices of ``X`` (times ``f``) into ``t`` at ``indices`` along ``axis``."""
    return emit("sparse_accumulate_", kernels.sparse_accumulate_, (t, X, indices, axis, f), modifies=t)


def _check_updater(name: str, weight: Any, time_step: Any, weight_decay: Any, beta1: Any, beta2: Any) -> Any:
    wd_needed = isinstance(weight_decay, Tensor) or (weight_decay is not None and weight_decay != 0.0)
    if wd_needed and weight is None:
        raise InvalidValueError(f"{name}: weight decay requires `weight`", where=user_source_line(),
                                   fix="pass the weight tensor, or weight_decay=None")
    if time_step is not None and (beta1 is None or beta2 is None):
        raise InvalidValueError(f"{name}: bias correction requires both beta1 and beta2",
                                   where=user_source_line(),
                                   fix="pass beta1 and beta2, or time_step=None for no bias correction")
    return weight_decay if wd_needed else None


def adam_updater(acc_first_order: Tensor, acc_second_order: Tensor, weight: Tensor | None = None,
                 time_step: Tensor | None = None, weight_decay: Factor | None = None,
                 beta1: Factor | None = None, beta2: Factor | None = None, epsilon: Factor = 1e-07) -> Tensor:
    """Adam's update term ``m̂ / (sqrt(v̂) + eps) (+ wd * w)``, a new tensor.

    Bias correction (``m̂ = m / (1 - beta1**t)``, same for ``v``) applies only when
    ``time_step`` is given; then ``time_step`` is first incremented in place, as in
    PopXL. ``m`` and ``v`` are not updated here: call the ``accumulate_moving_average*``
    ops first. The term is computed in float32 (or float64 for float64 states) even
    for float16 states, and returned in ``weight``'s dtype (``m``'s without a weight).
    As in PopXL, ``weight`` is only connected when weight decay needs it.
    """
    wd = _check_updater("adam_updater", weight, time_step, weight_decay, beta1, beta2)
    weight = weight if wd is not None else None
    args = (acc_first_order, acc_second_order, weight, time_step, wd, beta1, beta2, epsilon)
    writes = [time_step] if time_step is not None else []
    return emit("adam_updater", kernels.adam_updater, args, name="updater", writes=writes)


lamb_updater = adam_updater


def adamax_updater(acc_first_order: Tensor, acc_second_order: Tensor, weight: Tensor | None = None,
                   time_step: Tensor | None = None, weight_decay: Factor | None = None, beta1: Factor = 0.9,
                   epsilon: Factor = 1e-07) -> Tensor:
    """AdaMax's update term ``m / (1 - beta1**t) / (u + eps) (+ wd * w)``, a new tensor.

    ``acc_second_order`` is the infinity-norm accumulator ``u``. ``time_step`` is
    required and first incremented in place, as in PopXL. Computed in float32 (float64
    for float64 states) and returned in ``weight``'s dtype (``m``'s without a weight).

    Raises:
        InvalidValueError (a ValueError, as in PopXL): weight decay without ``weight``, or no ``time_step``.
    """
    wd = _check_updater("adamax_updater", weight, None, weight_decay, beta1, None)
    if time_step is None:
        raise InvalidValueError("adamax_updater: AdaMax requires time_step", where=user_source_line(),
                                   fix="pass the step counter tensor (a float32 scalar variable) as time_step=")
    weight = weight if wd is not None else None
    args = (acc_first_order, acc_second_order, weight, time_step, wd, beta1, epsilon)
    return emit("adamax_updater", kernels.adamax_updater, args, name="updater", writes=[time_step])


def adam_var_update(t: Tensor, x: Tensor, r1: Tensor, r2: Tensor, learning_rate: Factor | None = None,
                    max_weight_norm: Factor | None = None) -> Tensor:
    """LAMB's in-place step ``t -= lr * (|w| / |x|) * x`` with ``r1 = |w|²``, ``r2 = |x|²``.

    The trust ratio is 1 when either norm is 0; ``max_weight_norm`` clips ``|w|``.
    """
    if learning_rate is None:
        raise InvalidArgumentError("adam_var_update needs a learning_rate", where=user_source_line(),
                                   fix="pass learning_rate= as a number or scalar tensor")
    return emit("adam_var_update", kernels.adam_var_update_, (t, x, r1, r2, learning_rate, max_weight_norm), modifies=t)
