"""Kernel of popxl.addons' ``cross_entropy_sharded_wr_loss``: cross entropy of logits split
over the class axis between IPUs of one replica (tensor model parallelism within a replica).

The op reads every shard at once, as upstream's custom op (which exchanges the shards'
maxima and sums between the IPUs); torch autograd gives each shard its gradient,
``softmax - onehot`` restricted to its classes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cross_entropy_of_shards"]


def cross_entropy_of_shards(shards: int, *tensors: torch.Tensor) -> torch.Tensor:
    """Per-sample cross entropy (no reduction) of the logits ``tensors[:shards]`` (each
    ``(samples, classes of the shard)``, in class order) against the global class indices
    ``tensors[shards]``."""
    logits = torch.cat(tensors[:shards], dim=-1)
    return F.cross_entropy(logits, tensors[shards].long(), reduction="none")
