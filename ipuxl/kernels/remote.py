"""Kernels of the Streaming Memory ops (``ipuxl.ops.remote``) and of the RTS slices.

A remote op names its buffer by id; the kernel finds the running replica's Streaming
Memory (``buffer id -> (entries, *slot shape)`` tensor) through the thread's
*streaming memory*, which the device installs while it runs a replica
(``streaming_memory``; see ``ipuxl.device.streaming_memory``). So the same compiled
code serves every replica, in any graph.

The slices (``replica_sharded_slice``, ``replicated_slice``) take this replica's part of
a tensor every replica holds; as in PopXL their gradient is an all-gather of the
output gradient (``kernels.collectives``): each replica's shard of the gradient is
gathered into the full tensor.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from ipuxl.kernels import collectives

__all__ = [
    "streaming_memory", "active_streaming_memory", "remote_load", "remote_load_", "remote_store", "remote_code_load",
    "replica_sharded_slice", "replicated_slice",
]

_ACTIVE = threading.local()


@contextlib.contextmanager
def streaming_memory(store: dict[int, torch.Tensor] | None) -> Iterator[None]:
    """Run this thread's remote ops against ``store`` (buffer id -> slots); restored on exit."""
    saved = getattr(_ACTIVE, "store", None)
    _ACTIVE.store = store
    try:
        yield
    finally:
        _ACTIVE.store = saved


def active_streaming_memory() -> dict[int, torch.Tensor] | None:
    """The store installed for this thread (None outside a session's run)."""
    return getattr(_ACTIVE, "store", None)


def _slot(buffer_id: int, offset: Any, op: str) -> torch.Tensor:
    store = active_streaming_memory()
    if store is None or buffer_id not in store:
        raise RuntimeError(f"{op}: remote buffer {buffer_id} is not in this device's Streaming Memory: remote ops "
                           "run only inside a Session of the buffer's Ir (the buffer must exist when the Session is "
                           "created), and autodiff cannot trace them: load in the caller and pass the loaded tensor "
                           "to the differentiated graph as an input, as PopXL's phased execution does")
    slots = store[buffer_id]
    index = int(offset.reshape(-1)[0].item()) if isinstance(offset, torch.Tensor) else int(offset)
    if not 0 <= index < slots.shape[0]:
        raise IndexError(f"{op}: offset {index} is out of range for remote buffer {buffer_id} with "
                         f"{slots.shape[0]} entries (valid offsets: 0 to {slots.shape[0] - 1})")
    return slots[index]


def remote_load(buffer_id: int, offset: Any) -> torch.Tensor:
    """A copy of slot ``offset`` of the buffer."""
    return _slot(buffer_id, offset, "remote_load").clone()


def remote_load_(t: torch.Tensor, buffer_id: int, offset: Any) -> torch.Tensor:
    """Slot ``offset`` copied into ``t``."""
    return t.copy_(_slot(buffer_id, offset, "remote_load_"))


def remote_store(buffer_id: int, offset: Any, t: torch.Tensor) -> None:
    """``t`` copied into slot ``offset``."""
    _slot(buffer_id, offset, "remote_store").copy_(t)


def remote_code_load(graph_name: str, destination: str) -> None:
    """Code loading moves no tensor data: the device model accounts for it (``device.resources``)."""


# -- the slices ------------------------------------------------------------------------------------
def _sharded_slice(t: torch.Tensor, stride: int, group_size: int) -> torch.Tensor:
    flat = t.reshape(-1)
    size = -(-flat.numel() // group_size)
    pad = size * group_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    index = collectives.member_index(stride, group_size)
    return flat[index * size:(index + 1) * size].clone()


def _axis_slice(t: torch.Tensor, axis: int, stride: int, group_size: int) -> torch.Tensor:
    size = t.shape[axis] // group_size
    return t.narrow(axis, collectives.member_index(stride, group_size) * size, size).clone()


@torch.library.custom_op("ipuxl::replica_sharded_slice", mutates_args=())
def _sharded_slice_op(t: torch.Tensor, stride: int, group_size: int) -> torch.Tensor:
    return _sharded_slice(t, stride, group_size)


@_sharded_slice_op.register_fake
def _(t: torch.Tensor, stride: int, group_size: int) -> torch.Tensor:
    return t.new_empty((-(-t.numel() // group_size),))


@torch.library.custom_op("ipuxl::replicated_slice", mutates_args=())
def _axis_slice_op(t: torch.Tensor, axis: int, stride: int, group_size: int) -> torch.Tensor:
    return _axis_slice(t, axis, stride, group_size)


@_axis_slice_op.register_fake
def _(t: torch.Tensor, axis: int, stride: int, group_size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[axis] //= group_size
    return t.new_empty(shape)


class _ShardedSlice(torch.autograd.Function):
    @staticmethod
    def forward(t: torch.Tensor, stride: int, group_size: int) -> torch.Tensor:
        return torch.ops.ipuxl.replica_sharded_slice(t, stride, group_size)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.args, ctx.shape = inputs[1:3], list(inputs[0].shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        stride, group_size = ctx.args
        grad = torch.ops.ipuxl.all_gather(dy, 0, "meta_shape", stride, group_size, ctx.shape)
        return grad, None, None


class _AxisSlice(torch.autograd.Function):
    @staticmethod
    def forward(t: torch.Tensor, axis: int, stride: int, group_size: int) -> torch.Tensor:
        return torch.ops.ipuxl.replicated_slice(t, axis, stride, group_size)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.args = inputs[1:4]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        axis, stride, group_size = ctx.args
        grad = torch.ops.ipuxl.all_gather(dy, axis, "concat", stride, group_size, [])
        return grad, None, None, None


def replica_sharded_slice(t: torch.Tensor, stride: int, group_size: int) -> torch.Tensor:
    """This replica's 1-D shard of ``t`` (flattened, zero padded); its gradient is an all-gather."""
    if t.requires_grad:
        return _ShardedSlice.apply(t, stride, group_size)
    return torch.ops.ipuxl.replica_sharded_slice(t, stride, group_size)


def replicated_slice(t: torch.Tensor, axis: int, stride: int, group_size: int) -> torch.Tensor:
    """This replica's ``1 / group_size`` part of ``t`` along ``axis``; its gradient is an all-gather."""
    if t.requires_grad:
        return _AxisSlice.apply(t, axis, stride, group_size)
    return torch.ops.ipuxl.replicated_slice(t, axis, stride, group_size)
