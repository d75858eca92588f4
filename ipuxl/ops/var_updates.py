"""In-place variable updates (PopXL's ``ops.var_updates``).

Every ``*_`` op writes into its first argument and returns it. Factors may be Python
numbers (baked into the program) or scalar tensors (changeable at run time). As in
PopXL, ``t`` and ``X`` must have one shape (no broadcasting); ``X`` may have another
dtype and is converted to ``t``'s before any arithmetic.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ipuxl.dtypes import to_numpy_dtype
from ipuxl.ir.build import check_same_shape, emit
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.ops.reduce import lamb_square

__all__ = [
    "accumulate_", "accumulate_square_", "accumulate_mean_", "accumulate_moving_average_",
    "accumulate_moving_average_square_", "accumulator_scale_", "accumulator_zero_",
    "copy_var_update_", "sparse_accumulate_", "adam_updater", "lamb_updater", "adam_var_update",
    "lamb_square",
]

Factor = float | Tensor


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


def _accumulate(t: torch.Tensor, x: torch.Tensor, f: Any) -> torch.Tensor:
    x = x.to(t.dtype)
    return t.add_(x) if f is None else t.add_(x, alpha=f) if _is_number(f) else t.add_(x * f)


def _accumulate_square(t: torch.Tensor, x: torch.Tensor, f: Any) -> torch.Tensor:
    x = x.to(t.dtype)
    return t.addcmul_(x, x, value=f) if _is_number(f) else t.add_(x * x * f)


def _f32(f: Any) -> Any:
    """A Python-number factor rounded to float32, as PopART stores optimiser values."""
    return float(np.float32(f)) if _is_number(f) else f


def _moving_average(t: torch.Tensor, x: torch.Tensor, f: Any) -> torch.Tensor:
    x, f = x.to(t.dtype), _f32(f)
    if _is_number(f):
        return t.lerp_(x, 1 - f)  # one pass: t + (1 - f) * (x - t)
    t.mul_(f)
    return t.add_(x * (1 - f))


def _moving_average_square(t: torch.Tensor, x: torch.Tensor, f: Any) -> torch.Tensor:
    x, f = x.to(t.dtype), _f32(f)
    t.mul_(f)
    return t.addcmul_(x, x, value=1 - f) if _is_number(f) else t.add_(x * x * (1 - f))


def _mean(t: torch.Tensor, x: torch.Tensor, step: Any) -> torch.Tensor:
    x = x.to(t.dtype)
    t.mul_(step / (step + 1))
    return t.add_(x / (step + 1))


def _scale(t: torch.Tensor, f: Any) -> torch.Tensor:
    return t.zero_() if _is_number(f) and f == 0 else t.mul_(f)


def _sparse_accumulate(t: torch.Tensor, x: torch.Tensor, indices: torch.Tensor, axis: int, f: Any) -> torch.Tensor:
    x = x.to(t.dtype)
    return t.index_add_(axis, indices.long(), x if f is None else x * f)


def _update(op_name: str, kernel: Any, t: Tensor, X: Tensor, f: Any) -> Tensor:  # noqa: N803
    check_same_shape(op_name, t, X)
    return emit(op_name, kernel, (t, X, f), modifies=t, name=f"{op_name}_{t.name}")


def accumulate_(t: Tensor, X: Tensor, f: Factor | None = None) -> Tensor:  # noqa: N803
    """``t += X`` when ``f`` is None, else ``t += f * X``."""
    return _update("accumulate_", _accumulate, t, X, f)


def accumulate_square_(t: Tensor, X: Tensor, f: Factor = 1.0) -> Tensor:  # noqa: N803
    """``t += f * X**2``."""
    return _update("accumulate_square_", _accumulate_square, t, X, f)


def accumulate_mean_(t: Tensor, X: Tensor, step: Factor) -> Tensor:  # noqa: N803
    """Running mean: ``t = step/(step+1) * t + X/(step+1)`` (``step`` values seen before)."""
    return _update("accumulate_mean_", _mean, t, X, step)


def accumulate_moving_average_(t: Tensor, X: Tensor, f: Factor) -> Tensor:  # noqa: N803
    """``t = f * t + (1 - f) * X``."""
    return _update("accumulate_moving_average_", _moving_average, t, X, f)


def accumulate_moving_average_square_(t: Tensor, X: Tensor, f: Factor) -> Tensor:  # noqa: N803
    """``t = f * t + (1 - f) * X**2``."""
    return _update("accumulate_moving_average_square_", _moving_average_square, t, X, f)


def accumulator_scale_(t: Tensor, f: Factor) -> Tensor:
    """``t = f * t`` (``f == 0`` zeroes ``t``)."""
    return emit("accumulator_scale_", _scale, (t, f), modifies=t)


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
    return emit("sparse_accumulate_", _sparse_accumulate, (t, X, indices, axis, f), modifies=t)


def _fused_adam_step_(weight: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                      step: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float) -> torch.Tensor:
    """A whole bias-corrected Adam step (moments, step, update) in one ``torch._fused_adam_`` kernel.

    The device rewrites ``accumulate_moving_average_``, ``accumulate_moving_average_square_``,
    ``adam_updater`` and ``scaled_add_`` of one weight into this when nothing else reads
    the moments in between; the kernel is the one torch.optim.Adam(fused=True) uses.
    """
    step.add_(1)
    torch._fused_adam_([weight], [grad], [m], [v], [], [step], lr=lr, beta1=beta1, beta2=beta2,
                       weight_decay=0.0, eps=eps, amsgrad=False, maximize=False)
    return weight


def _has_data(t: torch.Tensor) -> bool:
    """False while shapes are inferred (meta) or a graph is traced (fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type != "meta" and not isinstance(t, FakeTensor)


def _adam_denominator(m: torch.Tensor, v: torch.Tensor, step: Any, beta1: Any, beta2: Any,
                      eps: Any) -> torch.Tensor:
    """``(sqrt(v̂) + eps) * (1 - beta1**t)``, so that ``m / it == m̂ / (sqrt(v̂) + eps)``.

    Everything is in float32 (float64 stays float64): a float16 ``v`` divided by
    ``1 - beta2**t`` (0.001 at t = 1) would lose precision and overflow float16.
    The bias corrections are folded into one scale of ``sqrt(v)``, so the whole
    denominator costs three passes over the tensor (the update step is memory-bound).
    """
    compute = torch.promote_types(m.dtype, torch.float32)
    denom = v.to(torch.promote_types(v.dtype, torch.float32)).sqrt()
    if step is None:
        return denom.add_(eps)
    step.add_(1)
    if _is_number(beta1) and _is_number(beta2) and _has_data(step):  # host scalars, as torch.optim does
        t = float(step)
        b1, b2 = float(np.array(beta1, to_numpy_dtype(compute))), float(np.array(beta2, to_numpy_dtype(compute)))
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        return denom.mul_(bc1 / bc2 ** 0.5).add_(eps * bc1)
    t = step.to(compute)
    bc1 = 1 - torch.pow(torch.as_tensor(beta1, dtype=compute, device=m.device), t)
    bc2 = 1 - torch.pow(torch.as_tensor(beta2, dtype=compute, device=m.device), t)
    return denom.mul_(bc1 / torch.sqrt(bc2)).add_(eps * bc1)


def _adam_updater(m: torch.Tensor, v: torch.Tensor, w: Any, step: Any, wd: Any, beta1: Any, beta2: Any,
                  eps: Any) -> torch.Tensor:
    out_dtype = w.dtype if w is not None else m.dtype
    denom = _adam_denominator(m, v, step, beta1, beta2, eps)
    out = torch.div(m, denom)
    if wd is not None:
        out = out.add_(w * wd)
    return out.to(out_dtype)


def _adam_update_(weight: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: Any, beta1: Any, beta2: Any,
                 eps: Any, alpha: float) -> torch.Tensor:
    """``weight += alpha * adam_updater(m, v, ...)`` (no weight decay) in one ``addcdiv_``.

    The device fuses an ``adam_updater`` whose only use is such an update into this.
    """
    denom = _adam_denominator(m, v, step, beta1, beta2, eps)
    return weight.addcdiv_(m.to(denom.dtype), denom, value=alpha)


def _check_updater(name: str, weight: Any, time_step: Any, weight_decay: Any, beta1: Any, beta2: Any) -> Any:
    wd_needed = isinstance(weight_decay, Tensor) or (weight_decay is not None and weight_decay != 0.0)
    if wd_needed and weight is None:
        raise InvalidArgumentError(f"{name}: weight decay requires `weight`", where=user_source_line(),
                                   fix="pass the weight tensor, or weight_decay=None")
    if time_step is not None and (beta1 is None or beta2 is None):
        raise InvalidArgumentError(f"{name}: bias correction requires both beta1 and beta2",
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
    return emit("adam_updater", _adam_updater, args, name="updater", writes=writes)


lamb_updater = adam_updater


def _adam_var_update(w: torch.Tensor, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, lr: Any,
                     max_norm: Any) -> torch.Tensor:
    norm_w = torch.sqrt(r1)
    if max_norm is not None:
        norm_w = torch.clamp(norm_w, max=max_norm)
    ratio = torch.where((r1 == 0) | (r2 == 0), torch.ones_like(norm_w), norm_w / torch.sqrt(r2))
    return w.sub_((lr * ratio * x).to(w.dtype))


def adam_var_update(t: Tensor, x: Tensor, r1: Tensor, r2: Tensor, learning_rate: Factor | None = None,
                    max_weight_norm: Factor | None = None) -> Tensor:
    """LAMB's in-place step ``t -= lr * (|w| / |x|) * x`` with ``r1 = |w|²``, ``r2 = |x|²``.

    The trust ratio is 1 when either norm is 0; ``max_weight_norm`` clips ``|w|``.
    """
    if learning_rate is None:
        raise InvalidArgumentError("adam_var_update needs a learning_rate", where=user_source_line(),
                                   fix="pass learning_rate= as a number or scalar tensor")
    return emit("adam_var_update", _adam_var_update, (t, x, r1, r2, learning_rate, max_weight_norm), modifies=t)
