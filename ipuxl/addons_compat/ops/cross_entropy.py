"""popxl.addons' cross entropy ops, with and without their gradient."""
from __future__ import annotations

import torch

from ipuxl.ir.graph_builder import constant
from ipuxl.ir.tensor import Tensor
from ipuxl.ops.nn import log_softmax, nll_loss, nll_loss_with_softmax_grad, softmax

__all__ = ["cross_entropy", "cross_entropy_with_grad"]


def cross_entropy(x: Tensor, targets: Tensor, ignore_index: int | None = None) -> Tensor:
    """Mean cross entropy of logits ``x`` (``(*dims, C)``) and integer ``targets`` (``dims``)."""
    return nll_loss(log_softmax(x, axis=-1), targets, ignore_index=ignore_index, log_prob=True)


def cross_entropy_with_grad(x: Tensor, targets: Tensor, loss_scaling: float | Tensor = 1,
                            ignore_index: int | None = None) -> tuple[Tensor, Tensor]:
    """Mean cross entropy ``l`` of logits ``x`` and ``dl/dx`` scaled by ``loss_scaling``.

    As upstream, the loss itself is not scaled; targets equal to ``ignore_index``
    contribute to neither.
    """
    probs = softmax(x, axis=-1)
    if not isinstance(loss_scaling, Tensor):
        loss_scaling = constant(loss_scaling, torch.float32, name="loss_scaling")
    return nll_loss_with_softmax_grad(probs, targets, loss_scaling, ignore_index=ignore_index)
