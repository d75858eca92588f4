"""Kernels of the collectives (``ipuxl.ops.collectives``): exact, in replica order.

A collective combines one tensor from every replica of a group. The kernel does not
know how replicas run: it asks the thread's *exchange* (``current_replica``), which
the device installs while it runs a replica (``running_as``; the device's
``Communicator`` meets the other replicas, see ``ipuxl.device.replicas``). Outside
any replica (one replica, or a plain call) a collective acts on the one tensor.

Reductions fold the group's tensors in replica order: the same arithmetic in every
process, so results are bitwise identical however the replicas are spread.

``all_reduce_ipus`` is the one collective within a replica (PopXL's ``all_reduce``
across the IPUs of a replica): the simulated device holds every IPU's tensor in one
process, so it reduces them in IPU order with the same folds.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from ipuxl.errors import AutodiffError, ReplicationError
from ipuxl.ir.replica_grouping import ReplicaGrouping

__all__ = [
    "Combine", "Exchange", "current_replica", "member_index", "running_as", "REDUCTIONS",
    "all_reduce", "all_reduce_", "reduce_scatter", "all_gather", "all_gather_grad", "differentiable_all_gather",
    "all_reduce_ipus", "IPU_REDUCE_MODES",
]

#: ``combine(tensors of all replicas in order, wanted replicas)``: the results of the wanted replicas.
Combine = Callable[[list[torch.Tensor], Sequence[int]], list[torch.Tensor]]


class Exchange(Protocol):
    """Where the replicas of a program meet (the device's ``Communicator``)."""

    replication_factor: int

    def exchange(self, replica: int, tensor: torch.Tensor, combine: Combine) -> torch.Tensor:
        """Deposit ``tensor`` of ``replica``; return its share of ``combine(all tensors)``."""
        ...


_RUNNING = threading.local()


def current_replica() -> tuple[Exchange | None, int]:
    """The exchange and global replica index of the running thread ((None, 0) outside any replica)."""
    return getattr(_RUNNING, "exchange", None), getattr(_RUNNING, "replica", 0)


def member_index(stride: int, group_size: int) -> int:
    """This replica's position in its group of ``(stride, group_size)`` (0 outside any replica)."""
    exchange, replica = current_replica()
    if exchange is None or group_size == 1:
        return 0
    return ReplicaGrouping(exchange.replication_factor, stride, group_size).members(replica).index(replica)


@contextlib.contextmanager
def running_as(exchange: Exchange | None, replica: int) -> Iterator[None]:
    """Run this thread's collectives as replica ``replica``, meeting the others through
    ``exchange`` (None: outside any replica); the previous setting is restored on exit."""
    saved = current_replica()
    _RUNNING.exchange, _RUNNING.replica = exchange, replica
    try:
        yield
    finally:
        _RUNNING.exchange, _RUNNING.replica = saved


# -- reductions -----------------------------------------------------------------------------
def _fold(tensors: Sequence[torch.Tensor], start: Callable[[torch.Tensor], torch.Tensor],
          step: Callable[[torch.Tensor, torch.Tensor], Any]) -> torch.Tensor:
    acc = start(tensors[0])
    for t in tensors[1:]:
        step(acc, t)
    return acc


def _sum(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    if ts[0].dtype == torch.bool:
        return _fold(ts, torch.clone, torch.Tensor.logical_or_)
    return _fold(ts, torch.clone, torch.Tensor.add_)


def _mean(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    total = _sum(ts)
    return total.div_(len(ts)) if total.is_floating_point() else total.div_(len(ts), rounding_mode="floor")


def _logical(ts: Sequence[torch.Tensor], step: Callable[[torch.Tensor, torch.Tensor], Any]) -> torch.Tensor:
    return _fold([t.bool() for t in ts], torch.clone, step).to(ts[0].dtype)


#: The reduction of each ``op`` name: the group's tensors in replica order -> a new tensor.
REDUCTIONS: dict[str, Callable[[Sequence[torch.Tensor]], torch.Tensor]] = {
    "add": _sum,
    "mean": _mean,
    "mul": lambda ts: _fold(ts, torch.clone, torch.Tensor.mul_),
    "min": lambda ts: _fold(ts, torch.clone, lambda a, t: torch.minimum(a, t, out=a)),
    "max": lambda ts: _fold(ts, torch.clone, lambda a, t: torch.maximum(a, t, out=a)),
    "and": lambda ts: _logical(ts, torch.Tensor.logical_and_),
    "or": lambda ts: _logical(ts, torch.Tensor.logical_or_),
    "square_add": lambda ts: _fold(ts, lambda t: t * t, lambda a, t: a.addcmul_(t, t)),
}

PerGroup = Callable[[list[torch.Tensor], int], torch.Tensor]


def _collective(t: torch.Tensor, stride: int, group_size: int, per_group: PerGroup, what: str,
                shared: str = "") -> torch.Tensor:
    """This replica's result of ``per_group(its group's tensors in order, its index in the group)``.

    ``shared``: "" computes per member; "copy" computes once per group and gives the
    other members copies (they may write them); "same" gives every member the one
    result (the caller only reads it).
    """
    exchange, replica = current_replica()
    replicas = exchange.replication_factor if exchange is not None else 1
    if replicas % (stride * group_size):
        raise ReplicationError(f"{what}: a group of size {group_size} (stride {stride}) does not divide the "
                               f"{replicas} replicas running this program",
                               fix="build the program for the replication factor the session runs")
    if exchange is None:
        return per_group([t], 0)
    grouping = ReplicaGrouping(replicas, stride, group_size)

    def combine(tensors: list[torch.Tensor], wanted: Sequence[int]) -> list[torch.Tensor]:
        done: dict[tuple[int, int], torch.Tensor] = {}
        out = []
        for r in wanted:
            members = grouping.members(r)
            index = members.index(r)
            key = (grouping.assignment[r], index if not shared else 0)
            if key in done:
                out.append(done[key].clone() if shared == "copy" else done[key])
            else:
                done[key] = per_group([tensors[m] for m in members], index)
                out.append(done[key])
        return out

    return exchange.exchange(replica, t, combine)


# -- the kernels ------------------------------------------------------------------------------
def all_reduce(t: torch.Tensor, op: str, stride: int, group_size: int) -> torch.Tensor:
    """``REDUCTIONS[op]`` of ``t`` over this replica's group, a new tensor."""
    reduce = REDUCTIONS[op]
    return _collective(t, stride, group_size, lambda members, index: reduce(members),
                       "replicated_all_reduce", shared="copy")


def all_reduce_(t: torch.Tensor, op: str, stride: int, group_size: int) -> torch.Tensor:
    """``all_reduce`` written into ``t``."""
    reduce = REDUCTIONS[op]
    result = _collective(t, stride, group_size, lambda members, index: reduce(members),
                         "replicated_all_reduce_", shared="same")
    return t.copy_(result)


def reduce_scatter(t: torch.Tensor, op: str, stride: int, group_size: int) -> torch.Tensor:
    """Member ``i``'s 1-D slice of the reduction of the group's flattened, zero-padded ``t``."""
    reduce = REDUCTIONS[op]
    shard = -(-t.numel() // group_size)

    def per_group(members: list[torch.Tensor], index: int) -> torch.Tensor:
        pad = shard * group_size - t.numel()
        flat = [torch.nn.functional.pad(m.reshape(-1), (0, pad)) if pad else m.reshape(-1) for m in members]
        return reduce([f[index * shard:(index + 1) * shard] for f in flat])

    return _collective(t, stride, group_size, per_group, "replicated_reduce_scatter")


def all_gather(t: torch.Tensor, axis: int, mode: str, stride: int, group_size: int,
               meta_shape: tuple[int, ...] = ()) -> torch.Tensor:
    """The group's ``t`` stacked (``mode`` "new_axis", and scalars), concatenated along ``axis``
    ("concat") or reshaped to ``meta_shape`` ("meta_shape")."""
    def per_group(members: list[torch.Tensor], index: int) -> torch.Tensor:
        if mode == "new_axis" or members[0].dim() == 0:  # scalars: concat is a new axis
            return torch.stack(members)
        if mode == "meta_shape":
            return torch.cat([m.reshape(-1) for m in members])[:math.prod(meta_shape)].reshape(meta_shape)
        return torch.cat(members, dim=axis)  # "concat"

    return _collective(t, stride, group_size, per_group, "replicated_all_gather", shared="copy")


# -- the differentiable all-gather ----------------------------------------------------------------
# ``all_gather`` as a torch custom op (one node when traced, whatever the exchange) with an
# ``autograd.Function`` whose backward is PopXL's: each replica takes its own slice (or shard,
# for ``meta_shape``) of its own output gradient (a replicated slice; PopART's ``Local``
# reduce-scatter), not summed over the replicas. That is the true gradient when every replica's
# output gradient is the same; popxl.addons reduce-scatters the gradients of sharded weights itself.
def _gather_shape(shape: list[int], axis: int, mode: str, group_size: int, meta_shape: list[int]) -> list[int]:
    if mode == "new_axis" or not shape:
        return [group_size, *shape]
    if mode == "meta_shape":
        return list(meta_shape)
    return [d * group_size if i == axis % len(shape) else d for i, d in enumerate(shape)]


@torch.library.custom_op("ipuxl::all_gather", mutates_args=())
def _all_gather_op(t: torch.Tensor, axis: int, mode: str, stride: int, group_size: int,
                   meta_shape: list[int]) -> torch.Tensor:
    out = all_gather(t, axis, mode, stride, group_size, tuple(meta_shape))
    return out.clone() if out.data_ptr() == t.data_ptr() else out


@_all_gather_op.register_fake
def _(t: torch.Tensor, axis: int, mode: str, stride: int, group_size: int, meta_shape: list[int]) -> torch.Tensor:
    return t.new_empty(_gather_shape(list(t.shape), axis, mode, group_size, meta_shape))


def all_gather_grad(dy: torch.Tensor, axis: int, mode: str, stride: int, group_size: int,
                    in_shape: list[int]) -> torch.Tensor:
    """The gradient of ``all_gather`` for this replica's input, as PopXL defines it: this member's
    own part of its own ``dy``, with no communication (a replicated slice: PopART's reduce-scatter
    with the ``Local`` operator). Nothing is summed over the group: where the replicas' ``dy``
    differ and the sum is wanted, reduce them (``replicated_reduce_scatter``) instead."""
    index = member_index(stride, group_size)
    if mode == "meta_shape":  # this member's 1-D shard of the flattened, zero-padded dy
        flat = dy.reshape(-1)
        size = -(-flat.numel() // group_size)
        if size * group_size > flat.numel():
            flat = torch.nn.functional.pad(flat, (0, size * group_size - flat.numel()))
        return flat[index * size:(index + 1) * size].reshape(in_shape).clone()
    if mode == "new_axis" or len(in_shape) == 0:  # scalars are gathered along a new axis
        return dy.select(0, index).clone()
    size = in_shape[axis % len(in_shape)]
    return dy.narrow(axis, index * size, size).clone()


@torch.library.custom_op("ipuxl::all_gather_grad", mutates_args=())
def _all_gather_grad_op(dy: torch.Tensor, axis: int, mode: str, stride: int, group_size: int,
                        in_shape: list[int]) -> torch.Tensor:
    return all_gather_grad(dy, axis, mode, stride, group_size, in_shape)


@_all_gather_grad_op.register_fake
def _(dy: torch.Tensor, axis: int, mode: str, stride: int, group_size: int, in_shape: list[int]) -> torch.Tensor:
    return dy.new_empty(in_shape)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(t: torch.Tensor, axis: int, mode: str, stride: int, group_size: int,
                meta_shape: list[int]) -> torch.Tensor:
        return torch.ops.ipuxl.all_gather(t, axis, mode, stride, group_size, meta_shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.args, ctx.in_shape = inputs[1:5], list(inputs[0].shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        axis, mode, stride, group_size = ctx.args
        grad = torch.ops.ipuxl.all_gather_grad(dy, axis, mode, stride, group_size, ctx.in_shape)
        return grad, None, None, None, None, None


def differentiable_all_gather(t: torch.Tensor, axis: int, mode: str, stride: int, group_size: int,
                              meta_shape: tuple[int, ...] = ()) -> torch.Tensor:
    """``all_gather`` with a gradient (this member's slice of the output gradient), traceable as one node."""
    if t.requires_grad:
        return _AllGather.apply(t, axis, mode, stride, group_size, list(meta_shape))
    return torch.ops.ipuxl.all_gather(t, axis, mode, stride, group_size, list(meta_shape))


# -- within one replica: across its IPUs -----------------------------------------------------
#: ``mode`` of ``all_reduce_ipus``: PopXL's ``all_reduce`` and its two identical-tensor forms.
IPU_REDUCE_MODES = ("all_reduce", "identical_inputs", "identical_grad_inputs")


def _reduce_ipus(op: str, mode: str, ts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The forward values: ``identical_inputs`` is the identity (the inputs are equal),
    the other modes give every IPU the reduction of all inputs, in IPU order."""
    if mode == "identical_inputs":
        return tuple(t.clone() for t in ts)
    reduced = REDUCTIONS[op](list(ts))
    return (reduced, *(reduced.clone() for _ in ts[1:]))


class _AllReduceIpus(torch.autograd.Function):
    """PopXL's gradients: ``all_reduce`` (add) and ``identical_inputs`` sum the output
    gradients for every input; ``identical_grad_inputs`` passes each output's gradient
    to its input (the gradients are equal). Other ops have no gradient, as upstream."""

    @staticmethod
    def forward(op: str, mode: str, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _reduce_ipus(op, mode, ts)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.op, ctx.mode = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if ctx.op != "add":
            raise AutodiffError(f"all_reduce (across IPUs) with op '{ctx.op}' has no gradient: only 'add' is "
                                "supported by autodiff, as in PopXL",
                                fix="use op='add', or keep the all_reduce out of the differentiated graph")
        if ctx.mode == "identical_grad_inputs":
            return (None, None, *(g.clone() for g in grads))
        total = _sum(grads)
        return (None, None, total, *(total.clone() for _ in grads[1:]))


def all_reduce_ipus(ts: list[torch.Tensor], op: str, mode: str) -> tuple[torch.Tensor, ...]:
    """One result per input tensor (see ``IPU_REDUCE_MODES``); differentiable when an input requires grad."""
    if any(t.requires_grad for t in ts):
        return _AllReduceIpus.apply(op, mode, *ts)
    return _reduce_ipus(op, mode, ts)
