"""Farthest point sampling (PopTorch's ``fps``, torch_cluster's semantics) as a device kernel.

``torch.ops.ipuxl.fps`` is a torch custom op: a trace records it as one node whose
output size is known from ``ptr`` and ``ratio``, and the device runs the sampling loop
on the current points each time the program runs (no gradient: it returns indices).
"""
from __future__ import annotations

import math

import torch

__all__ = ["fps_counts"]


def fps_counts(ptr: list[int], ratio: float) -> list[int]:
    """How many points each segment ``[ptr[i], ptr[i+1])`` samples: ``ceil(ratio * size)``."""
    return [math.ceil(ratio * (end - start)) for start, end in zip(ptr[:-1], ptr[1:])]


def _sample(points: torch.Tensor, count: int, start: int) -> torch.Tensor:
    """``count`` indices into ``points``: ``start``, then each time the point farthest (squared
    Euclidean distance) from those chosen so far (the first such point on ties)."""
    chosen = torch.empty(count, dtype=torch.long)
    nearest = torch.full((points.shape[0],), float("inf"), dtype=torch.float64)
    current = start
    flat = points.reshape(points.shape[0], -1).double()
    for k in range(count):
        chosen[k] = current
        nearest = torch.minimum(nearest, (flat - flat[current]).pow(2).sum(1))
        current = int(torch.argmax(nearest))
    return chosen


@torch.library.custom_op("ipuxl::fps", mutates_args=())
def _fps(src: torch.Tensor, ptr: list[int], ratio: float, starts: list[int]) -> torch.Tensor:
    pieces = [_sample(src[a:b].cpu(), count, start) + a
              for a, b, count, start in zip(ptr[:-1], ptr[1:], fps_counts(ptr, ratio), starts)]
    return torch.cat(pieces).to(src.device) if pieces else torch.empty(0, dtype=torch.long, device=src.device)


@_fps.register_fake
def _(src: torch.Tensor, ptr: list[int], ratio: float, starts: list[int]) -> torch.Tensor:
    return src.new_empty((sum(fps_counts(ptr, ratio)),), dtype=torch.long)
