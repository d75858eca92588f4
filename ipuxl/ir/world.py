"""The process world: how many processes run one program, and which one this is.

A program launched with torchrun runs in several processes, each holding some of
the replicas. The IR asks this (``Ir.instance_replication_factor``) and so does the
device (``ipuxl.device.replicas`` re-exports ``world``), so it lives at the bottom.
"""
from __future__ import annotations

import os

__all__ = ["world"]


def world() -> tuple[int, int]:
    """``(number of processes, this process's rank)``: torchrun's, or (1, 0)."""
    import torch.distributed as dist  # loads the distributed package only when asked

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return (size, int(os.environ.get("RANK", "0"))) if size > 1 else (1, 0)
