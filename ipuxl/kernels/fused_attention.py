"""CUDA's fused (memory-efficient) attention for programs traced on the CPU.

A CPU trace records ``scaled_dot_product_attention`` as the CPU's fused kernel and its
backward (``kernels.attention``); on a CUDA device those run here as aten's
memory-efficient attention (``_scaled_dot_product_efficient_attention`` and its backward:
one kernel each way, no (queries x keys) matrix in memory), which takes float32, float16
and bfloat16, an additive mask and ``is_causal`` (top-left aligned, as the CPU kernel).

What ``scaled_dot_product_attention`` does before it calls that kernel is done here: a
boolean mask becomes its additive form (-inf where False) in the query's dtype, a mask
whose strides the kernel cannot read is padded to a multiple of 16 keys and sliced back,
and it is broadcast to (batch, heads, queries, keys). The kernel's log-sum-exp has its
query axis padded to a multiple of 32; the CPU trace's is not, so the forward hands back
its first ``queries`` columns (with 0 where every key is masked, as the CPU kernel) and
the backward pads them again.

``efficient_forward`` / ``efficient_backward`` return None where this path does not
apply: off CUDA, ``IPUXL_FUSED_ATTENTION=0`` in the environment,
``torch.backends.cuda.enable_mem_efficient_sdp(False)``, or arguments the kernel refuses
(its argument checks raise before it launches anything; such a case is remembered and
computed from matrix products from then on).
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

__all__ = ["efficient_forward", "efficient_backward", "fused_attention_enabled"]

_ALIGN_MASK = 16
"""The mask's strides the kernel reads must be multiples of this (torch pads masks likewise)."""
_ALIGN_LSE = 32
"""The kernel's log-sum-exp pads its query axis to a multiple of this."""
_REFUSED: set[tuple] = set()
"""Argument kinds the kernel refused once (computed from matrix products since)."""
_DEVICES = ("cuda",)
"""Device types with the kernels."""
_FORWARD = torch.ops.aten._scaled_dot_product_efficient_attention.default
_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default


def fused_attention_enabled() -> bool:
    """Whether CUDA programs may use the fused kernel (module docstring)."""
    return os.environ.get("IPUXL_FUSED_ATTENTION", "1") != "0" and torch.backends.cuda.mem_efficient_sdp_enabled()


def _kind(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None) -> tuple:
    return (query.dtype, query.shape[-1], value.shape[-1], query.dim(),
            None if attn_mask is None else (attn_mask.dtype, attn_mask.dim()))


def _applies(query: torch.Tensor, kind: tuple) -> bool:
    return query.device.type in _DEVICES and kind not in _REFUSED and fused_attention_enabled()


def _bias(attn_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """``attn_mask`` as the kernel reads it: additive, the query's dtype, aligned, 4-d."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~attn_mask, -math.inf)
    else:
        bias = attn_mask.to(query.dtype)
    if bias.stride(-1) != 1 or any(s % _ALIGN_MASK for s in bias.stride()[:-1]):
        keys = bias.shape[-1]
        bias = F.pad(bias, (0, -keys % _ALIGN_MASK or _ALIGN_MASK))[..., :keys]
    shape = (*query.shape[:-2], query.shape[-2], key.shape[-2])
    return bias.expand(shape)


def efficient_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
                      attn_mask: torch.Tensor | None, scale: float | None
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(output, logsumexp)`` as the CPU kernel returns them, from CUDA's fused kernel; None
    where it does not apply (module docstring)."""
    kind = _kind(query, key, value, attn_mask)
    if not _applies(query, kind):
        return None
    try:
        out, lse, _, _ = _FORWARD(
            query, key, value, _bias(attn_mask, query, key), True, 0.0, is_causal, scale=scale)
    except RuntimeError:
        _REFUSED.add(kind)
        return None
    lse = lse[..., :query.shape[-2]]
    return out, torch.where(torch.isneginf(lse), 0.0, lse)


def efficient_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool,
                       attn_mask: torch.Tensor | None, scale: float | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(grad_query, grad_key, grad_value)`` from CUDA's fused backward kernel; None where it
    does not apply (module docstring)."""
    kind = _kind(query, key, value, attn_mask)
    if not _applies(query, kind):
        return None
    lse = F.pad(logsumexp.float(), (0, -logsumexp.shape[-1] % _ALIGN_LSE)).contiguous()
    seed = torch.empty((), dtype=torch.int64, device=query.device)  # read only with dropout, which never comes here
    try:
        grads = _BACKWARD(
            grad_out, query, key, value, _bias(attn_mask, query, key), out, lse, seed, seed, 0.0,
            [True, True, True, False], is_causal, scale=scale)
    except RuntimeError:
        _REFUSED.add(kind)
        return None
    return grads[0], grads[1], grads[2]
