"""Attention computed from its definition, for programs traced on the CPU that run elsewhere.

Capture traces a PopTorch model on the host, so ``scaled_dot_product_attention`` records
the CPU's fused kernel, ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its
backward), which exists only for CPU tensors. On another device
(``device.retarget``) those calls become these two functions: the same results (output
and log-sum-exp, then the three input gradients) from matrix products, with the CPU
kernel's arguments, dtypes and output layouts:

* forward: ``scores = q @ k^T * scale`` (+ a float mask, or -inf where a boolean mask is
  False, or above the diagonal when causal), ``lse = logsumexp(scores)`` per query row,
  ``out = exp(scores - lse) @ v``; a row with every key masked gives zeros and lse 0, as
  the CPU kernel does;
* backward: the probabilities again from ``lse``, ``dv = p^T @ dout``,
  ``ds = p * (dout @ v^T - rowsum(dout * out))``, ``dq = ds @ k * scale``,
  ``dk = ds^T @ q * scale``.

On CUDA both run as CUDA's fused memory-efficient attention where it takes the arguments
(``kernels.fused_attention``); what follows is the path everywhere else.

Half-precision inputs are computed in float32 (the CPU kernel's accumulation type) and
rounded once. Attention dropout never reaches these (the CPU trace of an attention with
dropout takes aten's math path: softmax, a seeded Bernoulli mask, matmuls, which run
anywhere); a call with it is refused (``UnsupportedError``) rather than run without it.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ipuxl.errors import UnsupportedError
from ipuxl.kernels.fused_attention import efficient_backward, efficient_forward

__all__ = ["attention_forward", "attention_backward"]


def _check_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise UnsupportedError(
            f"attention dropout (dropout_p={dropout_p}) in a program traced on the CPU and run on another device: "
            "the CPU's fused attention kernel that the trace recorded has no counterpart here",
            fix="set the model's attention dropout probability to 0, or run on the CPU (ipuxl.Options().useIpuModel(True))")


def _scores(q: torch.Tensor, k: torch.Tensor, is_causal: bool, attn_mask: torch.Tensor | None,
            scale: float | None) -> tuple[torch.Tensor, float]:
    compute = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)).mul_(scale)
    if is_causal:
        length, keys = scores.shape[-2:]
        above = torch.ones(length, keys, dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(above, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.to(compute)
    return scores, scale


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)``: zero in rows whose keys are all masked (scores -inf)."""
    return torch.exp(scores - lse.unsqueeze(-1))


def _strided(value: torch.Tensor, like: tuple[Sequence[int], Sequence[int]] | None, dtype: torch.dtype) -> torch.Tensor:
    """``value`` in ``dtype`` with the traced output's strides (``like``: shape, stride); itself
    where it already is."""
    if like is None:
        return value.to(dtype)
    if value.dtype == dtype and tuple(value.shape) == tuple(like[0]) and value.stride() == tuple(like[1]):
        return value
    out = torch.empty_strided(tuple(like[0]), tuple(like[1]), dtype=dtype, device=value.device)
    return out.copy_(value)


def attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                      is_causal: bool = False, attn_mask: torch.Tensor | None = None, scale: float | None = None,
                      layouts: Sequence[tuple[Sequence[int], Sequence[int]] | None] = (None, None)
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu``'s ``(output, logsumexp)`` on any
    device (module docstring); ``layouts``: the traced outputs' (shape, stride). Arguments
    are named as in aten's schema."""
    _check_dropout(dropout_p)
    fused = efficient_forward(query, key, value, is_causal, attn_mask, scale)
    if fused is not None:
        return _strided(fused[0], layouts[0], query.dtype), _strided(fused[1], layouts[1], torch.float32)
    scores, _ = _scores(query, key, is_causal, attn_mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    lse = lse.masked_fill_(torch.isneginf(lse), 0.0)  # every key masked: lse 0 and zeros out, as the CPU kernel
    out = torch.matmul(_probabilities(scores, lse), value.to(scores.dtype))
    return _strided(out, layouts[0], query.dtype), _strided(lse, layouts[1], lse.dtype)


def attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, logsumexp: torch.Tensor, dropout_p: float = 0.0, is_causal: bool = False,
                       attn_mask: torch.Tensor | None = None, scale: float | None = None,
                       layouts: Sequence[tuple[Sequence[int], Sequence[int]] | None] = (None, None, None)
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``'s ``(grad_query,
    grad_key, grad_value)`` on any device (module docstring)."""
    _check_dropout(dropout_p)
    fused = efficient_backward(grad_out, query, key, value, out, logsumexp, is_causal, attn_mask, scale)
    if fused is not None:
        return (_strided(fused[0], layouts[0], query.dtype), _strided(fused[1], layouts[1], key.dtype),
                _strided(fused[2], layouts[2], value.dtype))
    scores, scale_used = _scores(query, key, is_causal, attn_mask, scale)
    compute = scores.dtype
    p = _probabilities(scores, logsumexp.to(compute))
    dout = grad_out.to(compute)
    dv = torch.matmul(p.transpose(-2, -1), dout)
    dp = torch.matmul(dout, value.to(compute).transpose(-2, -1))
    ds = p.mul_(dp.sub_((dout * out.to(compute)).sum(-1, keepdim=True)))
    dq = torch.matmul(ds, key.to(compute)).mul_(scale_used)
    dk = torch.matmul(ds.transpose(-2, -1), query.to(compute)).mul_(scale_used)
    return (_strided(dq, layouts[0], query.dtype), _strided(dk, layouts[1], key.dtype),
            _strided(dv, layouts[2], value.dtype))
