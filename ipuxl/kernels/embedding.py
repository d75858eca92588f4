"""Kernels of embedding gradients: a tied weight's gradient without its dense zeros.

``aten.embedding_dense_backward`` writes a dense gradient the size of the whole table:
zeros everywhere, then one row added per token. When that gradient is only added to
another one of the same table (a weight tied to an output projection, or one table
embedding two inputs), ``add_embedding_grad`` adds the token rows into the other gradient
directly: the table-sized zeros and the table-sized addition are never computed.
``ipuxl.device.rewrites.embedding_grads`` puts it in place of such additions.
"""
from __future__ import annotations

import torch

__all__ = ["add_embedding_grad", "embedding_grad_into"]


def add_embedding_grad(other: torch.Tensor, grad_output: torch.Tensor, indices: torch.Tensor, padding_idx: int,
                       in_place: bool) -> torch.Tensor:
    """``other + embedding_dense_backward(grad_output, indices, len(other), padding_idx, False)``.

    Each token's row of ``grad_output`` is added to row ``indices[i]`` of ``other`` (a copy
    of it unless ``in_place``), in token order; tokens equal to ``padding_idx`` (when it
    is not negative) add nothing, as in aten's kernel (off the CPU they add zeros: the same
    values, but a -0.0 there becomes +0.0). Numerics: aten sums a row's tokens
    first and adds the sum to ``other``; here each token is added to ``other`` in turn,
    so a row that two or more tokens share may differ in its last bits.
    """
    rows = grad_output.reshape(-1, grad_output.shape[-1])
    index = indices.reshape(-1)
    if padding_idx >= 0:
        kept = index != padding_idx
        if rows.device.type == "cpu":
            rows, index = rows[kept], index[kept]
        else:  # a boolean index would make the host wait for the device: add zero rows instead
            rows = rows * kept.unsqueeze(1).to(rows.dtype)
    out = other if in_place else other.clone()
    return out.index_add_(0, index, rows.to(out.dtype))


def embedding_grad_into(out: torch.Tensor, grad_output: torch.Tensor, indices: torch.Tensor,
                        padding_idx: int) -> torch.Tensor:
    """``embedding_dense_backward(grad_output, indices, len(out), padding_idx, False)`` written
    into ``out`` (zeroed first): bit for bit aten's, which adds each token's row into
    zeros in token order too. The device's memory plan writes a large dense embedding
    gradient into a kept buffer this way (``device.memory_plan``)."""
    return add_embedding_grad(out.zero_(), grad_output, indices, padding_idx, True)
