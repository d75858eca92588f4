"""The process world: how many processes run one program, and which one this is.

A program launched with torchrun runs in several processes, each holding some of
the replicas. The IR asks this (``Ir.instance_replication_factor``) and so does the
device (``ipuxl.device.replicas`` re-exports ``world``), so it lives at the bottom.

``total_replicas`` is the replica count of a multi-instance program (PopXL's
``Ir(replication="popdist")``, ``popdist.getNumTotalReplicas``): PopRun's
``POPDIST_NUM_TOTAL_REPLICAS`` when the environment sets it, else
``POPDIST_NUM_LOCAL_REPLICAS`` per process, else one replica per process.
"""
from __future__ import annotations

import os

__all__ = ["world", "total_replicas", "local_replicas"]


def world() -> tuple[int, int]:
    """``(number of processes, this process's rank)``: torchrun's, or (1, 0)."""
    import torch.distributed as dist  # loads the distributed package only when asked

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return (size, int(os.environ.get("RANK", "0"))) if size > 1 else (1, 0)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def local_replicas() -> int:
    """Replicas each process runs: ``POPDIST_NUM_LOCAL_REPLICAS``, else the total's share, else 1."""
    local = _env_int("POPDIST_NUM_LOCAL_REPLICAS")
    if local is not None:
        return local
    total = _env_int("POPDIST_NUM_TOTAL_REPLICAS")
    return total // world()[0] if total is not None else 1


def total_replicas() -> int:
    """Replicas of the whole program: ``POPDIST_NUM_TOTAL_REPLICAS``, else ``local_replicas()``
    times the number of processes."""
    total = _env_int("POPDIST_NUM_TOTAL_REPLICAS")
    return total if total is not None else local_replicas() * world()[0]
