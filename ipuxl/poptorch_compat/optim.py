"""PopTorch's optimisers (``poptorch.optim``): ``torch.optim`` classes plus PopTorch's extra arguments.

``SGD``, ``Adam``, ``AdamW`` and ``RMSprop`` subclass the ``torch.optim`` class of
the same name and take the same arguments, followed by PopTorch 3.x's extras
(keyword only); ``LAMB`` is a ``torch.optim.Optimizer`` of its own. All of them
subclass :class:`Optimizer`. Every extra is an optimizer attribute, as upstream
(``opt.loss_scaling = 512.0``, ``opt.accum_type``), and is also recorded in
``defaults`` and in every param group, where ipuxl reads it; groups may differ in
the accumulator dtypes and ``bias_correction`` (an ipuxl extension) but not in
``loss_scaling`` and ``max_grad_norm``, which are one value per optimiser.
``opt.variable_attrs`` (:class:`VariableAttributes`) records which attributes are
variable, as upstream (the arguments passed explicitly).

With every extra at its default the eager ``.step()`` *is* ``torch.optim``'s, as
upstream's is. Extras:

* ``loss_scaling``: on the device the loss is multiplied by it before the backward
  pass and the gradients divided by it before the update, as PopTorch does (no
  numeric effect beyond rounding). The eager ``.step()`` ignores it, as upstream's.
* ``max_grad_norm`` (SGD, Adam, AdamW; default ``inf``): the gradients of all the
  optimiser's parameters are scaled by ``max_grad_norm / max(norm, max_grad_norm)``
  (``norm``: their global L2 norm) before the update, in the eager step too.
* ``accum_type``: dtype for accumulating gradients over micro-batches; recorded
  (ipuxl accumulates in the gradient's dtype).
* ``first_order_momentum_accum_type`` / ``second_order_momentum_accum_type``
  (``velocity_accum_type`` for SGD): dtypes of the optimiser states, float32 by
  default as upstream (float16 and float64 weights then keep float32 states).
  Adam/AdamW/LAMB: ``exp_avg`` / ``exp_avg_sq`` (and ``max_exp_avg_sq``); RMSprop:
  ``square_avg`` / ``grad_avg``; SGD: ``momentum_buffer``. ``None`` means the
  weight's dtype. A state of another dtype is stored rounded to it and read back
  into the weight's dtype for the arithmetic, as ``ipuxl.optim.rules`` does.
* ``bias_correction`` (AdamW, LAMB), ``max_weight_norm`` (LAMB: ``None`` means
  65500, PopTorch's float16 maximum; ``float("inf")`` turns the clipping off).
* ``velocity_scaling`` and ``use_combined_accum`` (SGD): recorded. Both of
  PopTorch's SGD variants are mathematically torch's SGD, and the combined variant
  divides the velocity scaling out again: no effect on a simulated device.
  Without ``use_combined_accum`` upstream warns that ``velocity_scaling`` is
  ignored; so does ipuxl (logger ``poptorch::python``).
* ``use_tf_variant`` (RMSprop): TensorFlow's RMSprop, as upstream: ``square_avg``
  starts at one, ``eps`` goes inside the square root and the learning rate into
  the momentum buffer.

Unlike PopTorch, ``amsgrad=True`` (Adam, AdamW) and ``nesterov=True`` (SGD) work.
A parameter whose states have another dtype, or an AdamW without bias correction, is
updated by an eager implementation of the same formula (``ipuxl.optim.rules``); the
other parameters go through ``torch.optim``'s own step.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterable

import torch

from ipuxl.poptorch_compat.optim_base import (
    INF, LAMB_MAX_WEIGHT_NORM, Optimizer, VariableAttributes, explicit_state_dtypes, number, records_explicit_args,
    scalar_dtype,
)

__all__ = ["Optimizer", "VariableAttributes", "SGD", "Adam", "AdamW", "RMSprop", "LAMB"]

_LOG = logging.getLogger("poptorch::python")


# -- eager rule helpers --------------------------------------------------------------
def _state(state: dict[str, Any], key: str, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``state[key]`` in ``dtype`` (created as zeros, or converted when its dtype differs)."""
    t = state.get(key)
    if t is None:
        t = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    elif t.dtype != dtype:
        t = t.to(dtype)
    state[key] = t
    return t


def _step(state: dict[str, Any]) -> torch.Tensor:
    step = state.get("step")
    if not isinstance(step, torch.Tensor):
        step = torch.tensor(float(step or 0), dtype=scalar_dtype())
        state["step"] = step
    step += 1
    return step


def _store(t: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t[...] = value`` rounded to ``t``'s dtype; returns the stored value read back in ``dtype``."""
    t.copy_(value)
    return t.to(dtype)


def _dtype_of(group: dict[str, Any], rule: str, state: str, p: torch.Tensor) -> torch.dtype:
    return explicit_state_dtypes(group, rule).get(state, p.dtype)


# -- SGD ------------------------------------------------------------------------------------
class SGD(Optimizer, torch.optim.SGD):
    """``torch.optim.SGD`` with PopTorch's extras (see the module docstring).

    Extras: ``loss_scaling=1.0``, ``velocity_scaling=1.0``, ``use_combined_accum=False``,
    ``accum_type=torch.float32``, ``velocity_accum_type=torch.float32``
    (``momentum_buffer``'s dtype), ``max_grad_norm=inf``.
    """

    _rule = "sgd"
    _torch_base = torch.optim.SGD

    @records_explicit_args
    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float | torch.Tensor = 0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, differentiable: bool = False,
                 fused: bool | None = None, loss_scaling: float = 1.0, velocity_scaling: float = 1.0,
                 use_combined_accum: bool = False, accum_type: torch.dtype | None = torch.float32,
                 velocity_accum_type: torch.dtype | None = torch.float32,
                 max_grad_norm: float | None = INF) -> None:
        if velocity_scaling != 1.0 and not use_combined_accum:
            _LOG.warning("velocity_scaling value ignored when using the separate variant (use_combined_accum=False)")
        self._set_extras(dict(loss_scaling=loss_scaling, velocity_scaling=velocity_scaling,
                              use_combined_accum=use_combined_accum, accum_type=accum_type,
                              velocity_accum_type=velocity_accum_type,
                              max_grad_norm=INF if max_grad_norm is None else max_grad_norm))
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize,
                         foreach=foreach, differentiable=differentiable, fused=fused)
        self._finish_extras()

    def _own_update(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        return group["momentum"] != 0 and super()._own_update(group, p)

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        lr, momentum, dampening = number(group["lr"]), number(group["momentum"]), number(group["dampening"])
        wd = number(group["weight_decay"])
        dtype = torch.promote_types(p.dtype, grad.dtype)
        state = self.state[p]
        d_p = grad if wd == 0 else grad.add(p, alpha=wd)
        first = state.get("momentum_buffer") is None
        buf = _state(state, "momentum_buffer", p, _dtype_of(group, "sgd", "momentum_buffer", p))
        new = d_p.to(dtype, copy=True) if first else buf.to(dtype).mul_(momentum).add_(d_p, alpha=1 - dampening)
        b = _store(buf, new, dtype)
        d_p = d_p.add(b, alpha=momentum) if group["nesterov"] else b
        p.add_(d_p.to(p.dtype), alpha=-lr)


# -- Adam / AdamW ---------------------------------------------------------------------------
def _adam_update(self: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor,
                 bias_correction: bool) -> None:
    """torch.optim.Adam's single-tensor step, with states of their own dtypes and optional
    bias correction (the formula of ``rules.adam_``)."""
    lr, eps, wd = number(group["lr"]), number(group["eps"]), number(group["weight_decay"])
    beta1, beta2 = (number(b) for b in group["betas"])
    decoupled = group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW))
    state = self.state[p]
    step_t = _step(state)
    m_t = _state(state, "exp_avg", p, _dtype_of(group, "adam", "first_order", p))
    v_t = _state(state, "exp_avg_sq", p, _dtype_of(group, "adam", "second_order", p))
    if wd != 0:
        if decoupled:
            p.mul_(1 - lr * wd)
        else:
            grad = grad.add(p, alpha=wd)
    dtype = torch.promote_types(p.dtype, grad.dtype)
    m = _store(m_t, m_t.to(dtype).lerp(grad.to(dtype), 1 - beta1), dtype)
    v = _store(v_t, v_t.to(dtype).mul(beta2).addcmul_(grad, grad, value=1 - beta2), dtype)
    if group["amsgrad"]:
        mx_t = _state(state, "max_exp_avg_sq", p, _dtype_of(group, "adam", "max_second_order", p))
        v = _store(mx_t, torch.maximum(mx_t.to(dtype), v), dtype)
    step = float(step_t.item())
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    compute = torch.promote_types(dtype, torch.float32)
    denom = (v.to(compute).sqrt() / math.sqrt(bc2)).add_(eps)
    p.add_((m.to(compute) / denom).to(p.dtype), alpha=-lr / bc1)


class Adam(Optimizer, torch.optim.Adam):
    """``torch.optim.Adam`` with PopTorch's extras (see the module docstring).

    Extras: ``loss_scaling=1.0``, ``accum_type=torch.float32``,
    ``first_order_momentum_accum_type=torch.float32`` (``exp_avg``),
    ``second_order_momentum_accum_type=torch.float32`` (``exp_avg_sq``, ``max_exp_avg_sq``),
    ``max_grad_norm=inf``. Unlike PopTorch, ``amsgrad=True`` is supported.
    """

    _rule = "adam"
    _torch_base = torch.optim.Adam

    @records_explicit_args
    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False, loss_scaling: float = 1.0,
                 accum_type: torch.dtype | None = torch.float32,
                 first_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 second_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 max_grad_norm: float | None = INF) -> None:
        self._set_extras(dict(loss_scaling=loss_scaling, accum_type=accum_type,
                              first_order_momentum_accum_type=first_order_momentum_accum_type,
                              second_order_momentum_accum_type=second_order_momentum_accum_type,
                              max_grad_norm=INF if max_grad_norm is None else max_grad_norm))
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=decoupled_weight_decay)
        self._finish_extras()

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        _adam_update(self, group, p, grad, True)


class AdamW(Optimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` with PopTorch's extras (see the module docstring).

    Extras: ``loss_scaling=1.0``, ``bias_correction=True``, ``accum_type=torch.float32``,
    ``first_order_momentum_accum_type=torch.float32``,
    ``second_order_momentum_accum_type=torch.float32``, ``max_grad_norm=inf``.
    """

    _rule = "adam"
    _torch_base = torch.optim.AdamW

    @records_explicit_args
    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, loss_scaling: float = 1.0, bias_correction: bool = True,
                 accum_type: torch.dtype | None = torch.float32,
                 first_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 second_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 max_grad_norm: float | None = INF) -> None:
        self._set_extras(dict(loss_scaling=loss_scaling, bias_correction=bias_correction, accum_type=accum_type,
                              first_order_momentum_accum_type=first_order_momentum_accum_type,
                              second_order_momentum_accum_type=second_order_momentum_accum_type,
                              max_grad_norm=INF if max_grad_norm is None else max_grad_norm))
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused)
        self._finish_extras()

    def _own_update(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        return not group.get("bias_correction", True) or super()._own_update(group, p)

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        _adam_update(self, group, p, grad, group.get("bias_correction", True))


# -- RMSprop ------------------------------------------------------------------------------
class RMSprop(Optimizer, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` with PopTorch's extras (see the module docstring).

    Extras: ``loss_scaling=1.0``, ``accum_type=torch.float32``,
    ``first_order_momentum_accum_type=torch.float32`` (``square_avg``),
    ``second_order_momentum_accum_type=torch.float32`` (``grad_avg``),
    ``use_tf_variant=False`` (True: TensorFlow's variant, see the module docstring).
    """

    _rule = "rmsprop"
    _torch_base = torch.optim.RMSprop

    @records_explicit_args
    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-2, alpha: float = 0.99,
                 eps: float = 1e-8, weight_decay: float = 0, momentum: float = 0, centered: bool = False,
                 capturable: bool = False, foreach: bool | None = None, maximize: bool = False,
                 differentiable: bool = False, *, loss_scaling: float = 1.0,
                 accum_type: torch.dtype | None = torch.float32,
                 first_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 second_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 use_tf_variant: bool = False) -> None:
        self._set_extras(dict(loss_scaling=loss_scaling, accum_type=accum_type,
                              first_order_momentum_accum_type=first_order_momentum_accum_type,
                              second_order_momentum_accum_type=second_order_momentum_accum_type,
                              use_tf_variant=use_tf_variant))
        super().__init__(params, lr, alpha, eps, weight_decay, momentum, centered, capturable=capturable,
                         foreach=foreach, maximize=maximize, differentiable=differentiable)
        self._finish_extras()

    def _own_update(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        if group.get("use_tf_variant", False):
            return True
        dtypes = explicit_state_dtypes(group, "rmsprop")
        if not group["centered"]:
            dtypes.pop("grad_avg", None)
        return any(d != p.dtype for d in dtypes.values())

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        lr, alpha, eps = number(group["lr"]), number(group["alpha"]), number(group["eps"])
        wd, momentum = number(group["weight_decay"]), number(group["momentum"])
        tf = group.get("use_tf_variant", False)
        state = self.state[p]
        _step(state)
        fresh = "square_avg" not in state
        s_t = _state(state, "square_avg", p, _dtype_of(group, "rmsprop", "square_avg", p))
        if tf and fresh:
            s_t.fill_(1.0)  # TensorFlow starts the average of squares at one
        if wd != 0:
            grad = grad.add(p, alpha=wd)
        dtype = torch.promote_types(p.dtype, grad.dtype)
        s = _store(s_t, s_t.to(dtype).mul(alpha).addcmul_(grad, grad, value=1 - alpha), dtype)
        if group["centered"]:
            a_t = _state(state, "grad_avg", p, _dtype_of(group, "rmsprop", "grad_avg", p))
            a = _store(a_t, a_t.to(dtype).lerp(grad.to(dtype), 1 - alpha), dtype)
            s = s.addcmul(a, a, value=-1)
        avg = s.add(eps).sqrt_() if tf else s.sqrt().add_(eps)
        if momentum > 0:
            b_t = _state(state, "momentum_buffer", p, p.dtype)
            b = _store(b_t, b_t.to(dtype).mul(momentum).addcdiv_(grad, avg, value=lr if tf else 1.0), dtype)
            p.add_(b.to(p.dtype), alpha=-1.0 if tf else -lr)
        else:
            p.add_((grad / avg).to(p.dtype), alpha=-lr)


# -- LAMB --------------------------------------------------------------------------------------
class LAMB(Optimizer, torch.optim.Optimizer):
    """Layer-wise Adaptive Moments (LAMB, You et al. 2019), PopTorch's ``poptorch.optim.LAMB``.

    For each parameter, with ``g = p.grad / loss_scaling`` and ``t`` the step after
    incrementing it (the formula of ``ipuxl.optim.rules.lamb_``)::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        m_hat = m / (1 - beta1**t), v_hat = v / (1 - beta2**t)   (bias_correction; else m, v)
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
        r = min(||w||, max_weight_norm) / ||u||      (r = 1 when ||w|| or ||u|| is 0)
        w -= lr * r * u

    Norms are over the whole parameter, from float32 sums of squares; ``u`` is computed
    in float32 (float64 for float64 parameters). States are torch-named: ``step``
    (a float32 scalar tensor, as torch.optim.Adam's), ``exp_avg``, ``exp_avg_sq``.

    Args (PopTorch's, defaults included): ``lr=1e-3``, ``betas=(0.9, 0.999)``,
    ``eps=1e-8``, ``weight_decay=1e-2``, ``bias_correction=True``, ``loss_scaling=1.0``,
    ``max_weight_norm=None`` (65500.0; ``inf`` for none), ``accum_type=torch.float32``,
    ``first_order_momentum_accum_type=torch.float32``,
    ``second_order_momentum_accum_type=torch.float32``.
    """

    _rule = "lamb"

    @records_explicit_args
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, bias_correction: bool = True,
                 loss_scaling: float = 1.0, max_weight_norm: float | None = None,
                 accum_type: torch.dtype | None = torch.float32,
                 first_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 second_order_momentum_accum_type: torch.dtype | None = torch.float32) -> None:
        lr_, eps_, wd_ = number(lr), number(eps), number(weight_decay)
        if not lr_ >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps_ >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= number(beta) < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not wd_ >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self._set_extras(dict(bias_correction=bias_correction, loss_scaling=loss_scaling,
                              max_weight_norm=LAMB_MAX_WEIGHT_NORM if max_weight_norm is None else max_weight_norm,
                              accum_type=accum_type, first_order_momentum_accum_type=first_order_momentum_accum_type,
                              second_order_momentum_accum_type=second_order_momentum_accum_type))
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._finish_extras()

    def _own_update(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        return True

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        lr, eps, wd = number(group["lr"]), number(group["eps"]), number(group["weight_decay"])
        beta1, beta2 = (number(b) for b in group["betas"])
        mwn = group.get("max_weight_norm", LAMB_MAX_WEIGHT_NORM)
        mwn = LAMB_MAX_WEIGHT_NORM if mwn is None else float(mwn)
        state = self.state[p]
        step_t = _step(state)
        m_t = _state(state, "exp_avg", p, _dtype_of(group, "lamb", "first_order", p))
        v_t = _state(state, "exp_avg_sq", p, _dtype_of(group, "lamb", "second_order", p))
        dtype = torch.promote_types(p.dtype, grad.dtype)
        m = _store(m_t, m_t.to(dtype).mul(beta1).add_(grad, alpha=1 - beta1), dtype)
        v = _store(v_t, v_t.to(dtype).mul(beta2).addcmul_(grad, grad, value=1 - beta2), dtype)
        step = float(step_t.item())
        bc1 = 1 - beta1 ** step if group.get("bias_correction", True) else 1.0
        bc2 = 1 - beta2 ** step if group.get("bias_correction", True) else 1.0
        compute = torch.promote_types(dtype, torch.float32)
        u = (m.to(compute) / bc1) / (v.to(compute).sqrt() / math.sqrt(bc2) + eps)
        if wd != 0:
            u = u.add_(p.to(compute), alpha=wd)
        u = u.to(p.dtype)
        r1 = p.float().square().sum()
        r2 = u.float().square().sum()
        if r1 == 0 or r2 == 0:
            ratio = torch.ones(())
        else:
            ratio = torch.clamp(r1.sqrt(), max=mwn) / r2.sqrt()
        p.sub_((lr * ratio * u).to(p.dtype))
