"""The host data of a host-to-device stream: its shape checked against the program's
``(num_host_transfers, replicas, *stream shape)`` (each leading dim dropped when it is 1)
and, with replicas, the slices of this process's replicas kept; and a run's outputs brought
back to the host (``to_host``)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from ipuxl import fp8_utils

from ipuxl.errors import ReplicationError, StreamInputError
from ipuxl.ir.streams import HostToDeviceStream

__all__ = ["full_shape", "replica_slice", "to_host", "host_tensors"]


def full_shape(shape: Sequence[int], steps: int, replicas: int) -> tuple[int, ...]:
    """Host data shape: ``(steps, replicas, *shape)`` without leading dims of size 1."""
    return tuple(d for d in (steps, replicas) if d > 1) + tuple(shape)


def replica_slice(stream: HostToDeviceStream, tensor: torch.Tensor, *, steps: int, replicas: int,
                  local: Sequence[int], distributed: bool, replicated: bool, where: str) -> torch.Tensor:
    """``tensor`` checked against the stream's host data shape; when ``replicated``, shaped
    ``(steps, local replicas, *shape)``: this process's replicas of the whole data (or the
    data of this process's replicas only, under torchrun)."""
    got = tuple(tensor.shape)
    expected = full_shape(stream.shape, steps, replicas)
    if got != expected and all(d == 1 for d in stream.shape) and tensor.numel() == math.prod(expected):
        # PopXL's special case: a stream of one element per slice takes data with any
        # arrangement of size-1 dims (a scalar for a shape-(1,) stream)
        tensor, got = tensor.reshape(expected), expected
    if not replicated:
        if got != expected:
            _raise_shape(stream, got, steps, replicas, len(local), distributed, where)
        return tensor
    if got == expected:
        full = tensor.reshape(steps, replicas, *stream.shape)
        return full[:, local[0]:local[-1] + 1] if distributed else full
    if distributed and got == full_shape(stream.shape, steps, len(local)):
        return tensor.reshape(steps, len(local), *stream.shape)
    _raise_shape(stream, got, steps, replicas, len(local), distributed, where)
    raise AssertionError("unreachable")


def _raise_shape(stream: HostToDeviceStream, got: tuple[int, ...], steps: int, replicas: int, local: int,
                 distributed: bool, where: str) -> None:
    expected = full_shape(stream.shape, steps, replicas)
    axis = 1 if steps > 1 else 0
    if (replicas > 1 and len(got) == len(expected)
            and got[:axis] + got[axis + 1:] == expected[:axis] + expected[axis + 1:]):
        process = f" (or {local} for this process's replicas)" if distributed else ""
        raise ReplicationError(
            f"Session.run: input stream '{stream.name}' has replica dimension {got[axis]} (axis {axis}), "
            f"the program has {replicas} replicas{process}: expected shape {expected}, got {got}",
            where=where,
            fix="give one slice per replica: (num_host_transfers, replication_factor, *stream.shape), "
                "each leading dim dropped when it is 1")
    raise StreamInputError(
        f"Session.run: input stream '{stream.name}' expects shape {expected} "
        f"(stream shape {stream.shape}, num_host_transfers={steps}, replication_factor={replicas}), got {got}",
        fix="give (num_host_transfers, replication_factor, *stream.shape) data, each leading dim dropped "
            "when it is 1")


def to_host(outputs: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """A run's stored outputs as host arrays of ``shapes`` (bfloat16 as float32: numpy has
    none), copied as ``host_tensors`` copies them. The arrays keep their host tensors alive."""
    hosted = host_tensors([t.to(torch.float32) if t.dtype == torch.bfloat16 else t for t in outputs])
    return [fp8_utils.to_host(t).reshape(tuple(shape)) for t, shape in zip(hosted, shapes)]


def host_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the host. From a GPU each is copied into page-locked host memory
    (torch's caching host allocator, so the pages come back run after run), all copies
    queued before one wait: a copy to ordinary pages is several times slower (the driver
    stages it), and a language model's logits are tens of MiB per run. Host tensors are
    returned as they are."""
    hosted = []
    for tensor in tensors:
        tensor = tensor.detach()
        if tensor.device.type == "cuda":
            tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)
        hosted.append(tensor.cpu())
    if any(t.device.type == "cuda" for t in tensors):
        torch.cuda.current_stream().synchronize()
    return hosted
