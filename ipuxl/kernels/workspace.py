"""The device's workspace: buffers that a compiled program's large results are written into.

A program runs the same graphs with the same shapes on every step, so a large result
(a language-model head's logits, a table-sized gradient) can be written into a buffer
kept from one step and one run to the next, instead of a new allocation each time. On
the CPU a new allocation of more than a few MiB comes from the operating system as
fresh pages, and the first write to each page faults and zeroes it: a 150 MiB gradient
spends tens of milliseconds there, each step. ``ipuxl.device.memory_plan`` decides which
results get a buffer (results whose lifetimes do not overlap share one) and makes their
ops write into ``buffer(...)``'s tensor (their ``out=`` form).

Each replica has its own buffers (replicas in threads take turns mid-step); a buffer is
made on first use with the result's shape, strides and dtype.
"""
from __future__ import annotations

import torch

from ipuxl.kernels.collectives import current_replica

__all__ = ["Workspace", "buffer"]


class Workspace:
    """A session's buffers, by replica and slot (slots are numbered by ``new_slot``)."""

    def __init__(self) -> None:
        self._slots = 0
        self._buffers: dict[int, dict[int, torch.Tensor]] = {}

    def new_slot(self) -> int:
        """A slot number no other result of this workspace's programs uses."""
        self._slots += 1
        return self._slots - 1

    @property
    def num_slots(self) -> int:
        return self._slots

    def nbytes(self) -> int:
        """Bytes held by the buffers made so far, all replicas."""
        return sum(t.untyped_storage().nbytes() for slots in self._buffers.values() for t in slots.values())

    def clear(self) -> None:
        """Free every buffer (they are made again on next use)."""
        self._buffers.clear()

    def __repr__(self) -> str:
        return f"Workspace({self._slots} slots, {self.nbytes() / 2**20:.1f} MiB held)"


def buffer(workspace: Workspace, slot: int, shape: list[int], stride: list[int], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """Slot ``slot``'s buffer for the running replica (made on first use, uninitialised)."""
    slots = workspace._buffers.setdefault(current_replica()[1], {})
    held = slots.get(slot)
    if held is None:
        held = slots[slot] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return held
