"""Kernels that keep a run-time check fake tensors cannot make.

Capture runs the model on fake tensors, so a check that needs tensor *values* is
skipped there; some decompositions then drop it from the traced graph altogether.
Each op here runs torch's own kernel on the device, so the check (and torch's error
type and message) happens at run time, as in eager PyTorch.

* ``ipuxl::one_hot(indices, num_classes)``: ``F.one_hot``, which raises a RuntimeError
  for a class outside ``[0, num_classes)``; its traced decomposition silently gives a
  zero row instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["one_hot"]


@torch.library.custom_op("ipuxl::one_hot", mutates_args=())
def one_hot(indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``F.one_hot(indices, num_classes)`` with torch's range check at run time."""
    return F.one_hot(indices, num_classes)


@one_hot.register_fake
def _(indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    return indices.new_empty((*indices.shape, num_classes), dtype=torch.int64)
