"""Kernels of the variable updates (``ipuxl.ops.var_updates``) and the device's fused Adam steps.

Each function is the target of one fx node: the ops emit the plain kernels, and the
device's compile-time rewrites (``ipuxl.device.rewrites``) match them and put the fused
ones (``adam_update_``, ``fused_adam_steps_``) in their place. Functions ending in
``_`` write into their first argument and return it. A factor ``f`` is a Python
number (baked into the program) or a scalar tensor (changeable at run time); ``x`` is
converted to ``t``'s dtype before any arithmetic.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from ipuxl.dtypes import to_numpy_dtype
from ipuxl.kernels import unsigned

__all__ = [
    "accumulate_", "accumulate_square_", "running_mean_", "moving_average_", "moving_average_square_", "scale_",
    "sparse_accumulate_", "adam_updater", "adamax_updater", "adam_update_", "fused_adam_steps_", "adam_var_update_",
    "scaled_addmm_", "sgd_momentum_step_", "reads_on_host",
]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


def _factor(f: Any, dtype: torch.dtype) -> Any:
    """A Python-number factor rounded to float32, as PopART stores optimiser values; kept
    whole for float64 tensors (no IPU has them: eager PyTorch's double precision applies)."""
    return float(np.float32(f)) if _is_number(f) and dtype != torch.float64 else f


def accumulate_(t: torch.Tensor, x: torch.Tensor, f: Any) -> torch.Tensor:
    """``t += x`` when ``f`` is None, else ``t += f * x`` (uint16/uint32, which torch's CPU
    kernels cannot add, wrap modulo ``2**bits`` as the IPU's unsigned arithmetic)."""
    if unsigned.is_widened(t.dtype) and not isinstance(t, FakeTensor):
        wide = t.to(torch.int64)
        return t.copy_(unsigned.add(t, accumulate_(wide, x.to(torch.int64), f) - t.to(torch.int64)))
    x = x.to(t.dtype)
    return t.add_(x) if f is None else t.add_(x, alpha=f) if _is_number(f) else t.add_(x * f)


def accumulate_square_(t: torch.Tensor, x: torch.Tensor, f: Any) -> torch.Tensor:
    """``t += f * x**2``."""
    x = x.to(t.dtype)
    return t.addcmul_(x, x, value=f) if _is_number(f) else t.add_(x * x * f)


def moving_average_(t: torch.Tensor, x: torch.Tensor, f: Any) -> torch.Tensor:
    """``t = f * t + (1 - f) * x`` (a number ``f`` rounded to float32 unless ``t`` is float64)."""
    x, f = x.to(t.dtype), _factor(f, t.dtype)
    if _is_number(f):
        return t.lerp_(x, 1 - f)  # one pass: t + (1 - f) * (x - t)
    t.mul_(f)
    return t.add_(x * (1 - f))


def moving_average_square_(t: torch.Tensor, x: torch.Tensor, f: Any) -> torch.Tensor:
    """``t = f * t + (1 - f) * x**2`` (a number ``f`` rounded to float32 unless ``t`` is float64)."""
    x, f = x.to(t.dtype), _factor(f, t.dtype)
    t.mul_(f)
    return t.addcmul_(x, x, value=1 - f) if _is_number(f) else t.add_(x * x * (1 - f))


def running_mean_(t: torch.Tensor, x: torch.Tensor, step: Any) -> torch.Tensor:
    """``t = step/(step+1) * t + x/(step+1)`` (``step`` values seen before)."""
    x = x.to(t.dtype)
    t.mul_(step / (step + 1))
    return t.add_(x / (step + 1))


def scale_(t: torch.Tensor, f: Any) -> torch.Tensor:
    """``t *= f`` (a number ``f == 0`` zeroes ``t``, NaNs and infinities included)."""
    return t.zero_() if _is_number(f) and f == 0 else t.mul_(f)


def sparse_accumulate_(t: torch.Tensor, x: torch.Tensor, indices: torch.Tensor, axis: int, f: Any) -> torch.Tensor:
    """Add the slices of ``x`` (times ``f`` unless None) into ``t`` at ``indices`` along ``axis``."""
    x = x.to(t.dtype)
    return t.index_add_(axis, indices.long(), x if f is None else x * f)


# -- Adam ---------------------------------------------------------------------------------------
def reads_on_host(*scalars: Any) -> bool:
    """Whether a kernel reads these factors (numbers, 0-dim tensors or None) as host numbers:
    unless one is a tensor on another device than the CPU. Reading a CUDA tensor's value on
    the host makes the host wait for the GPU, in every step of a device loop."""
    return not any(isinstance(s, torch.Tensor) and s.device.type != "cpu" for s in scalars)


def _has_data(t: torch.Tensor) -> bool:
    """False while shapes are inferred (meta) or a graph is traced (fake tensors)."""
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
    if _is_number(beta1) and _is_number(beta2) and _has_data(step) and reads_on_host(step):  # as torch.optim does
        t = float(step)
        b1, b2 = float(np.array(beta1, to_numpy_dtype(compute))), float(np.array(beta2, to_numpy_dtype(compute)))
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        return denom.mul_(bc1 / bc2 ** 0.5).add_(eps * bc1)
    t_step = step.to(compute)
    bc1_t = 1 - torch.pow(torch.as_tensor(beta1, dtype=compute, device=m.device), t_step)
    bc2_t = 1 - torch.pow(torch.as_tensor(beta2, dtype=compute, device=m.device), t_step)
    return denom.mul_(bc1_t / torch.sqrt(bc2_t)).add_(eps * bc1_t)


def adam_updater(m: torch.Tensor, v: torch.Tensor, w: Any, step: Any, wd: Any, beta1: Any, beta2: Any,
                 eps: Any) -> torch.Tensor:
    """Adam's update term ``m̂ / (sqrt(v̂) + eps) (+ wd * w)`` in ``w``'s dtype (``m``'s
    without ``w``); ``step`` (when not None) is incremented first, in place."""
    out_dtype = w.dtype if w is not None else m.dtype
    denom = _adam_denominator(m, v, step, beta1, beta2, eps)
    out = torch.div(m, denom)
    if wd is not None:
        out = out.add_(w * wd)
    return out.to(out_dtype)


def adamax_updater(m: torch.Tensor, u: torch.Tensor, w: Any, step: torch.Tensor, wd: Any, beta1: Any,
                   eps: Any) -> torch.Tensor:
    """AdaMax's update term ``m / (1 - beta1**t) / (u + eps) (+ wd * w)`` after ``step += 1``,
    computed in float32 (float64 stays float64), returned in ``w``'s dtype (``m``'s without ``w``)."""
    out_dtype = w.dtype if w is not None else m.dtype
    compute = torch.promote_types(m.dtype, torch.float32)
    step.add_(1)
    correction = 1 - torch.pow(torch.as_tensor(beta1, dtype=compute, device=m.device), step.to(compute))
    out = m.to(compute) / correction / (u.to(compute) + eps)
    if wd is not None:
        out = out + w.to(compute) * wd
    return out.to(out_dtype)


def adam_update_(weight: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: Any, beta1: Any, beta2: Any,
                 eps: Any, alpha: float) -> torch.Tensor:
    """``weight += alpha * adam_updater(m, v, ...)`` (no weight decay) in one ``addcdiv_``.

    The device fuses an ``adam_updater`` whose only use is such an update into this.
    """
    denom = _adam_denominator(m, v, step, beta1, beta2, eps)
    return weight.addcdiv_(m.to(denom.dtype), denom, value=alpha)


def scaled_addmm_(state: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, a: Any, b: float) -> torch.Tensor:
    """``state = a * state + b * (m1 @ m2)`` as one GEMM into ``state`` (beta ``a``, alpha ``b``).

    The device rewrites a momentum update ``scaled_add_(buf, mm(m1, m2), a, b)`` of a
    matmul gradient into this, so the gradient is never written to memory and read back
    and ``buf`` is read and written once. A CPU scalar-tensor ``a`` (a momentum variable)
    is read as the BLAS beta (the same float32 value); elsewhere ``state`` is scaled first.
    """
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu" or a.dim() != 0:
            return state.mul_(a).addmm_(m1, m2, alpha=b)
        a = a.item()
    return state.addmm_(m1, m2, beta=a, alpha=b)


#: ``torch._fused_sgd_`` rounds as the unfused steps in its vector loop, not in its scalar tail:
#: it gets the leading multiple of this many elements (a multiple of every CPU vector width)
_FUSED_SGD_BLOCK = 64
#: below this many elements (1 MiB of float32) the tensors stay in cache and the fused call's
#: overhead (~9 us) costs more than the passes it saves
FUSED_SGD_MIN_ELEMENTS = 1 << 18


def sgd_momentum_step_(weight: torch.Tensor, buf: torch.Tensor, grad: torch.Tensor, momentum: Any,
                       negative_lr: Any) -> torch.Tensor:
    """``buf = momentum * buf + grad; weight += negative_lr * buf``, mostly in one pass over
    the three tensors (``torch._fused_sgd_``, the kernel of ``torch.optim.SGD(fused=True)``).

    The device rewrites a momentum update followed by its weight update into this. On the
    CPU the fused kernel's vector loop computes the same float operations per element as
    the two ``mul_``/``add_`` steps and the ``addcmul_`` (bit for bit), reading and writing
    each tensor once instead of three times; its scalar tail does not, so the last
    ``numel % 64`` elements take the unfused steps. Tensors under ``FUSED_SGD_MIN_ELEMENTS``,
    and elsewhere (other devices or dtypes, non-contiguous tensors), take the unfused steps.
    """
    n = weight.numel()
    body = n - n % _FUSED_SGD_BLOCK
    tensors = (weight, buf, grad)
    if not (n >= FUSED_SGD_MIN_ELEMENTS and _fusable_sgd(tensors, momentum, negative_lr)):
        _unfused_sgd_momentum_step_(weight, buf, grad, momentum, negative_lr)
        return weight
    w, b, g = tensors if body == n else (t.view(-1)[:body] for t in tensors)
    torch._fused_sgd_([w], [g], [b], weight_decay=0.0, momentum=float(momentum), lr=-float(negative_lr),
                      dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
    if body < n:
        tail_w, tail_b, tail_g = (t.view(-1)[body:] for t in tensors)
        _unfused_sgd_momentum_step_(tail_w, tail_b, tail_g, momentum, negative_lr)
    return weight


def _fusable_sgd(tensors: tuple[torch.Tensor, ...], momentum: Any, negative_lr: Any) -> bool:
    """CPU float32/float64 tensors of one dtype and shape, contiguous, with scalar factors."""
    weight = tensors[0]
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.float64)
            and all(t.dtype == weight.dtype and t.shape == weight.shape and t.is_contiguous() for t in tensors)
            and all(s.device.type == "cpu" and s.dim() == 0 for s in (momentum, negative_lr)
                    if isinstance(s, torch.Tensor)))


def _unfused_sgd_momentum_step_(weight: torch.Tensor, buf: torch.Tensor, grad: torch.Tensor, momentum: Any,
                                negative_lr: Any) -> None:
    """The steps ``optim.rules.sgd_`` emits for a momentum update and its weight update."""
    buf.mul_(momentum).add_(grad)
    if isinstance(negative_lr, torch.Tensor):
        weight.addcmul_(buf, negative_lr)
    else:
        weight.add_(buf, alpha=negative_lr)


def fused_adam_steps_(weights: list[torch.Tensor], grads: list[torch.Tensor], ms: list[torch.Tensor],
                      vs: list[torch.Tensor], steps: list[torch.Tensor], negative_lr: Any, decay: Any,
                      weight_decay: Any, beta1: float, beta2: float, eps: float) -> None:
    """Whole bias-corrected Adam or AdamW steps of several weights in one multi-tensor kernel.

    Per weight, as ``optim.rules.adam_`` computes it: ``W *= decay`` (AdamW's decoupled
    weight decay; ``decay`` None: none), ``step += 1``, the moments, and
    ``W += negative_lr * (m̂ / (sqrt(v̂) + eps) + weight_decay * W)`` (``weight_decay`` None:
    no such term; popxl.addons' AdamW has it instead of ``decay``). The device rewrites the
    unfused steps of the weights that share these hyperparameters into this
    (``rewrites.adam_steps``); the
    kernel is torch's ``_fused_adamw_``, the one ``torch.optim.AdamW(fused=True)`` runs: one
    pass over each weight, gradient and moment.

    ``negative_lr``, ``decay`` and ``weight_decay`` are Python numbers or 0-dim tensors; at
    most one of ``decay`` and ``weight_decay`` is given. Numbers and CPU tensors are read on
    the host: the kernel scales each weight by ``1 - lr * weight_decay`` computed in double,
    so ``weight_decay = (1 - decay) / lr`` gives back the graph's ``decay`` (a float32 value)
    exactly after rounding; with ``lr == 0`` the weights are scaled separately. Tensors on
    another device (a CUDA session's optimiser variables) are never read on the host, which
    would make it wait for the device at every step: the weights are scaled by the decay
    (``1 + negative_lr * weight_decay`` for the other form) in one multi-tensor multiply,
    and the kernel takes the learning rate as a tensor.
    """
    torch._foreach_add_(steps, 1)
    lr: Any
    if reads_on_host(negative_lr, decay, weight_decay):
        lr = -float(negative_lr)
        factor = 1.0 if decay is None else float(decay)
        wd = 0.0 if weight_decay is None else float(weight_decay)
        if factor != 1.0:
            if lr != 0.0:
                wd = (1.0 - factor) / lr
            else:
                torch._foreach_mul_(weights, factor)
    else:
        lr, wd = -negative_lr, 0.0
        scale = decay if weight_decay is None else 1 + negative_lr * weight_decay
        if scale is not None:
            torch._foreach_mul_(weights, scale)
    # the kernel walks each tensor's memory in order: every tensor must be contiguous
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    strided = [i for i, ts in enumerate(zip(weights, ms, vs)) if not all(t.is_contiguous() for t in ts)]
    states = [list(weights), list(ms), list(vs)]
    for i in strided:
        for tensors in states:
            tensors[i] = tensors[i].contiguous()
    torch._fused_adamw_(states[0], grads, states[1], states[2], [], steps, lr=lr, beta1=float(beta1),
                        beta2=float(beta2), weight_decay=wd, eps=float(eps), amsgrad=False, maximize=False)
    for i in strided:
        for tensors, original in zip(states, (weights, ms, vs)):
            if tensors[i] is not original[i]:
                original[i].copy_(tensors[i])


def adam_var_update_(w: torch.Tensor, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, lr: Any,
                     max_norm: Any) -> torch.Tensor:
    """LAMB's step ``w -= lr * (|w| / |x|) * x`` with ``r1 = |w|²``, ``r2 = |x|²``; the trust
    ratio is 1 when either norm is 0, and ``max_norm`` (unless None) clips ``|w|``."""
    norm_w = torch.sqrt(r1)
    if max_norm is not None:
        norm_w = torch.clamp(norm_w, max=max_norm)
    ratio = torch.where((r1 == 0) | (r2 == 0), torch.ones_like(norm_w), norm_w / torch.sqrt(r2))
    return w.sub_((lr * ratio * x).to(w.dtype))
