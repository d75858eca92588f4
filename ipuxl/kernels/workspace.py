"""The device's workspace: memory that a compiled program's large results are written into.

A program runs the same graphs with the same shapes on every step, so a large result
(a language-model head's logits, a table-sized gradient) can be written into memory
kept from one step and one run to the next, instead of a new allocation each time. On
the CPU a new allocation of more than a few MiB comes from the operating system as
fresh pages, and the first write to each page faults and zeroes it: a 150 MiB gradient
spends tens of milliseconds there, each step. ``ipuxl.device.memory_plan`` decides which
results are kept and where: each planned graph gets an *arena* (one block of bytes) and
each of its results an offset in it, results whose lifetimes overlap at offsets that do
not (whatever their shapes: a head's weight gradient may take the bytes its logits had).
It makes their ops write into ``buffer(...)``'s tensor (their ``out=`` form).

Each replica has its own arenas (replicas in threads take turns mid-step); an arena is
made on first use.
"""
from __future__ import annotations

import torch

from ipuxl.kernels.collectives import current_replica

__all__ = ["Workspace", "buffer"]


class Workspace:
    """A session's arenas, by replica and arena number (numbered by ``new_arena``)."""

    ALIGN = 64
    """Offsets are multiples of this many bytes (a cache line; every dtype's alignment)."""

    def __init__(self) -> None:
        self._sizes: list[int] = []
        self._arenas: dict[int, dict[int, torch.Tensor]] = {}

    def new_arena(self, nbytes: int) -> int:
        """The number of a new arena of ``nbytes`` bytes."""
        self._sizes.append(nbytes)
        return len(self._sizes) - 1

    @property
    def num_arenas(self) -> int:
        return len(self._sizes)

    def arena_bytes(self, arena: int) -> int:
        """The size of arena ``arena`` (what each replica holds of it once used)."""
        return self._sizes[arena]

    def nbytes(self) -> int:
        """Bytes held by the arenas made so far, all replicas."""
        return sum(t.untyped_storage().nbytes() for arenas in self._arenas.values() for t in arenas.values())

    def clear(self) -> None:
        """Free every arena (they are made again on next use)."""
        self._arenas.clear()

    def __repr__(self) -> str:
        return f"Workspace({len(self._sizes)} arenas, {self.nbytes() / 2**20:.1f} MiB held)"


def buffer(workspace: Workspace, arena: int, offset: int, shape: list[int], stride: list[int], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """The tensor of ``shape``, ``stride`` and ``dtype`` at byte ``offset`` of arena ``arena``
    of the running replica (made on first use, uninitialised)."""
    arenas = workspace._arenas.setdefault(current_replica()[1], {})
    held = arenas.get(arena)
    if held is None:
        held = arenas[arena] = torch.empty(workspace._sizes[arena], dtype=torch.uint8, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(held.untyped_storage(), offset // dtype.itemsize,
                                                           shape, stride)
