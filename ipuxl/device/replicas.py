"""Replicas at run time: one program, R copies, exact collectives.

A session of an ``Ir(replication=R)`` runs the main program once per replica, each
replica with its own variables and its own slice of the host data. Replicas of this
process run in threads that take turns (one runs at a time, so torch's intra-op
threads are not oversubscribed and results do not depend on scheduling); a
collective op is a meeting point:

1. every replica deposits its tensor and waits at a barrier;
2. the last one to arrive stacks the tensors in replica order and, when the
   program spans several processes (torchrun), all-gathers the stacks over
   ``torch.distributed`` (gloo on CPU, NCCL on CUDA), so every process holds all R
   contributions in the same order;
3. the reduction runs once per group on that stack, in replica order, and each
   replica takes its result.

Because the reduction always runs on the same full stack in the same order, a
program split over processes gives bit-for-bit the results of the in-process run.
Cost per collective: one stack copy and one reduction per group, linear in R.

A replica that fails breaks the barrier, so the others stop instead of waiting;
a process that dies makes the all-gather of the others fail (gloo notices the
closed connection, or the process group's timeout ends the wait).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import os
import threading
from typing import Any, Callable, Sequence

import torch

from ipuxl.errors import ReplicaFailureError, ReplicationError

__all__ = ["world", "ensure_process_group", "Communicator", "run_replicas", "current_replica", "replica_alone",
           "all_reduce", "all_reduce_", "reduce_scatter", "all_gather", "REDUCTIONS"]

_LOCAL = threading.local()

#: How long a replica waits in a collective for the others (seconds); env IPUXL_REPLICA_TIMEOUT.
DEFAULT_TIMEOUT = 300.0


def _timeout() -> float:
    return float(os.environ.get("IPUXL_REPLICA_TIMEOUT", DEFAULT_TIMEOUT))


# -- processes --------------------------------------------------------------------------
def world() -> tuple[int, int]:
    """``(number of processes, this process's rank)``: torchrun's, or (1, 0)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return (size, int(os.environ.get("RANK", "0"))) if size > 1 else (1, 0)


def ensure_process_group(device: torch.device) -> None:
    """Join torchrun's process group (gloo on CPU, NCCL on CUDA) if not joined yet."""
    import torch.distributed as dist

    if dist.is_initialized() or world()[0] == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=_timeout()))
        # joined here, so left here: a group still alive at interpreter exit can abort the
        # process ("terminate called without an active exception") from gloo's threads
        atexit.register(_leave_process_group)
    except (RuntimeError, ValueError) as exc:
        raise ReplicaFailureError(
            f"could not join the torch.distributed process group ({backend}): {str(exc).splitlines()[0]}",
            where=f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')}",
            fix="launch with torchrun (it sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)") from exc


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# -- the meeting point ------------------------------------------------------------------
Combine = Callable[[list[torch.Tensor], Sequence[int]], list[torch.Tensor]]


class Communicator:
    """Collectives among ``replication_factor`` replicas, ``local`` of them in this process.

    Args:
        replication_factor: replicas in the whole program.
        local: global indices of the replicas this process runs (consecutive).
        distributed: whether other processes run the other replicas.
    """

    def __init__(self, replication_factor: int, local: Sequence[int], distributed: bool = False):
        self.replication_factor = replication_factor
        self.local = list(local)
        self.distributed = distributed
        self._slots: list[torch.Tensor | None] = [None] * len(self.local)
        self._combine: Combine | None = None
        self._results: list[torch.Tensor] = []
        self._barrier = threading.Barrier(len(self.local), action=self._meet)
        self._turn = threading.Lock()
        self._failure: BaseException | None = None

    def exchange(self, replica: int, tensor: torch.Tensor, combine: Combine) -> torch.Tensor:
        """Deposit ``tensor`` of ``replica``; return its share of ``combine(all R tensors)``."""
        i = replica - self.local[0]
        if len(self.local) == 1 and not self.distributed:
            return combine([tensor], [replica])[0]
        self._slots[i] = tensor
        self._combine = combine
        self._turn.release()
        try:
            self._barrier.wait(timeout=_timeout())
        except threading.BrokenBarrierError:
            raise ReplicaFailureError(
                f"replica {replica} stopped in a collective: another replica failed or did not reach it "
                f"within {_timeout():.0f} s", where=self._where(),
                fix="see the first error reported (the failing replica); IPUXL_REPLICA_TIMEOUT sets the wait"
            ) from self._failure
        finally:
            self._turn.acquire()
        return self._results[i]

    def _meet(self) -> None:
        """Barrier action (in the last replica to arrive): gather, then combine once.

        No replica runs until the action returns, so the combine reads the replicas'
        tensors in place; its results are new tensors.
        """
        try:
            tensors: list[torch.Tensor] = list(self._slots)  # type: ignore[arg-type]
            if self.distributed:
                tensors = list(self._all_gather_processes(torch.stack(tensors)).unbind(0))
            self._results = self._combine(tensors, self.local)  # type: ignore[misc]
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._slots = [None] * len(self.local)

    def _all_gather_processes(self, stacked: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(stacked) for _ in range(dist.get_world_size())]
        try:
            dist.all_gather(parts, stacked.contiguous())
        except (RuntimeError, ValueError) as exc:  # gloo: closed connection or timeout
            raise ReplicaFailureError(
                f"a collective across processes failed: {str(exc).splitlines()[0]}", where=self._where(),
                fix="another process probably died or stopped (see its output); a slow one may need a longer "
                    f"wait than IPUXL_REPLICA_TIMEOUT={_timeout():.0f} s") from exc
        return torch.cat(parts)

    def gather_processes(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every process's ``tensor`` along ``dim`` (outputs, weights)."""
        if not self.distributed:
            return tensor
        moved = tensor.movedim(dim, 0).contiguous()
        return self._all_gather_processes(moved).movedim(0, dim)

    def _where(self) -> str:
        size, rank = world()
        replicas = f"replicas {self.local[0]}..{self.local[-1]} of {self.replication_factor}"
        return f"{replicas}, process {rank} of {size}" if self.distributed else replicas

    # -- running the replicas ---------------------------------------------------------
    def abort(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._barrier.abort()


def current_replica() -> tuple[Communicator | None, int]:
    """The communicator and global replica index of the running thread ((None, 0) outside)."""
    return getattr(_LOCAL, "comm", None), getattr(_LOCAL, "replica", 0)


class _Alone:
    """Stands in for the other replicas while one replica's code runs by itself."""

    def __init__(self, replication_factor: int):
        self.replication_factor = replication_factor

    def exchange(self, replica: int, tensor: torch.Tensor, combine: Combine) -> torch.Tensor:
        return combine([tensor] * self.replication_factor, [replica])[0]


@contextlib.contextmanager
def replica_alone(replication_factor: int, replica: int) -> Any:
    """Run code in this thread as replica ``replica`` of ``replication_factor`` with nobody
    to meet: each collective takes this replica's tensor as every replica's contribution
    (right shapes and dtypes, not the real values). The device re-runs a failed step of one
    replica so, after the others have stopped, to find the op that failed."""
    saved = getattr(_LOCAL, "comm", None), getattr(_LOCAL, "replica", 0)
    _LOCAL.comm, _LOCAL.replica = _Alone(replication_factor), replica
    try:
        yield
    finally:
        _LOCAL.comm, _LOCAL.replica = saved


def run_replicas(comm: Communicator, work: Sequence[Callable[[], None]]) -> None:
    """Run ``work[i]`` as replica ``comm.local[i]``, taking turns; re-raise the first failure."""
    if len(work) == 1:
        _LOCAL.comm, _LOCAL.replica = comm, comm.local[0]
        comm._turn.acquire()
        try:
            work[0]()
        finally:
            comm._turn.release()
            _LOCAL.comm = None
        return
    errors: list[tuple[int, BaseException]] = []

    def body(i: int) -> None:
        _LOCAL.comm, _LOCAL.replica = comm, comm.local[i]
        comm._turn.acquire()
        try:
            work[i]()
        except BaseException as exc:
            errors.append((comm.local[i], exc))
            comm.abort(exc)
        finally:
            comm._turn.release()

    threads = [threading.Thread(target=body, args=(i,), name=f"ipuxl-replica-{r}", daemon=True)
               for i, r in enumerate(comm.local)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    comm._barrier.reset()
    comm._failure = None
    if errors:
        # the first real failure, not the replicas it stopped
        _, exc = next(((r, e) for r, e in errors if not isinstance(e, ReplicaFailureError)), errors[0])
        raise exc


# -- collectives ------------------------------------------------------------------------
# Reductions fold the group's tensors in replica order: the same arithmetic in every
# process, so results are bitwise identical however the replicas are spread.
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
    from ipuxl.ir.replica_grouping import ReplicaGrouping

    comm, replica = current_replica()
    replicas = comm.replication_factor if comm is not None else 1
    if replicas % (stride * group_size):
        raise ReplicationError(f"{what}: a group of size {group_size} (stride {stride}) does not divide the "
                               f"{replicas} replicas running this program",
                               fix="build the program for the replication factor the session runs")
    if comm is None:
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

    return comm.exchange(replica, t, combine)


def all_reduce(t: torch.Tensor, op: str, stride: int, group_size: int) -> torch.Tensor:
    reduce = REDUCTIONS[op]
    return _collective(t, stride, group_size, lambda members, index: reduce(members),
                       "replicated_all_reduce", shared="copy")


def all_reduce_(t: torch.Tensor, op: str, stride: int, group_size: int) -> torch.Tensor:
    reduce = REDUCTIONS[op]
    result = _collective(t, stride, group_size, lambda members, index: reduce(members),
                         "replicated_all_reduce_", shared="same")
    return t.copy_(result)


def reduce_scatter(t: torch.Tensor, op: str, stride: int, group_size: int) -> torch.Tensor:
    reduce = REDUCTIONS[op]
    shard = -(-t.numel() // group_size)

    def per_group(members: list[torch.Tensor], index: int) -> torch.Tensor:
        pad = shard * group_size - t.numel()
        flat = [torch.nn.functional.pad(m.reshape(-1), (0, pad)) if pad else m.reshape(-1) for m in members]
        return reduce([f[index * shard:(index + 1) * shard] for f in flat])

    return _collective(t, stride, group_size, per_group, "replicated_reduce_scatter")


def all_gather(t: torch.Tensor, axis: int, mode: str, stride: int, group_size: int,
               meta_shape: tuple[int, ...] = ()) -> torch.Tensor:
    def per_group(members: list[torch.Tensor], index: int) -> torch.Tensor:
        if mode == "new_axis" or members[0].dim() == 0:  # scalars: concat is a new axis
            return torch.stack(members)
        if mode == "meta_shape":
            return torch.cat([m.reshape(-1) for m in members])[:math.prod(meta_shape)].reshape(meta_shape)
        return torch.cat(members, dim=axis)  # "concat"

    return _collective(t, stride, group_size, per_group, "replicated_all_gather", shared="copy")
