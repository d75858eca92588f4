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

The collective ops' kernels (``ipuxl.kernels.collectives``) hold the reductions; they
find the running replica's ``Communicator`` through ``running_as``, which
``run_replicas`` sets in each replica's thread, so the kernels never import the device.
``world`` (the torchrun process world) is ``ipuxl.ir.world``'s, re-exported here.
"""
from __future__ import annotations

import atexit
import datetime
import os
import threading
from typing import Callable, ContextManager, Sequence

import torch

from ipuxl.errors import ReplicaFailureError
from ipuxl.ir.world import world
from ipuxl.kernels.collectives import Combine, running_as

__all__ = ["world", "ensure_process_group", "Communicator", "run_replicas", "replica_alone"]

#: How long a replica waits in a collective for the others (seconds); env IPUXL_REPLICA_TIMEOUT.
DEFAULT_TIMEOUT = 300.0


def _timeout() -> float:
    return float(os.environ.get("IPUXL_REPLICA_TIMEOUT", DEFAULT_TIMEOUT))


# -- processes --------------------------------------------------------------------------
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
        self._meetings = 0  # collectives completed (``_meet`` returned), ever

    def exchange(self, replica: int, tensor: torch.Tensor, combine: Combine) -> torch.Tensor:
        """Deposit ``tensor`` of ``replica``; return its share of ``combine(all R tensors)``."""
        i = replica - self.local[0]
        if len(self.local) == 1 and not self.distributed:
            return combine([tensor], [replica])[0]
        self._slots[i] = tensor
        self._combine = combine
        meetings = self._meetings
        self._turn.release()
        try:
            self._barrier.wait(timeout=_timeout())
        except threading.BrokenBarrierError:
            # A replica released from this meeting can find the barrier broken before it wakes
            # (another replica ran on, failed and aborted): the collective completed for it.
            if self._meetings > meetings:
                return self._results[i]
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
            tensors = [t for t in self._slots if t is not None]
            assert self._combine is not None and len(tensors) == len(self._slots), "every replica deposits first"
            if self.distributed:
                tensors = list(self._all_gather_processes(torch.stack(tensors)).unbind(0))
            self._results = self._combine(tensors, self.local)
            self._meetings += 1
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
        """Stop the replicas waiting in a collective (``exc`` failed one of them)."""
        if self._failure is None:
            self._failure = exc
        self._barrier.abort()


class _Alone:
    """Stands in for the other replicas while one replica's code runs by itself."""

    def __init__(self, replication_factor: int):
        self.replication_factor = replication_factor

    def exchange(self, replica: int, tensor: torch.Tensor, combine: Combine) -> torch.Tensor:
        return combine([tensor] * self.replication_factor, [replica])[0]


def replica_alone(replication_factor: int, replica: int) -> ContextManager[None]:
    """Run code in this thread as replica ``replica`` of ``replication_factor`` with nobody
    to meet: each collective takes this replica's tensor as every replica's contribution
    (right shapes and dtypes, not the real values). The device re-runs a failed step of one
    replica so, after the others have stopped, to find the op that failed."""
    return running_as(_Alone(replication_factor), replica)


def run_replicas(comm: Communicator, work: Sequence[Callable[[], None]]) -> None:
    """Run ``work[i]`` as replica ``comm.local[i]``, taking turns; re-raise the first failure."""
    if len(work) == 1:
        with running_as(comm, comm.local[0]):
            comm._turn.acquire()
            try:
                work[0]()
            finally:
                comm._turn.release()
        return
    errors: list[tuple[int, BaseException]] = []
    go = threading.Event()  # set once every thread has started: no replica runs before
    cancelled: list[bool] = []  # non-empty: the caller was interrupted before ``go``
    done = [threading.Event() for _ in work]  # replica i's work has returned (or never ran)

    def body(i: int) -> None:
        try:
            go.wait()
            if cancelled:
                return
            with running_as(comm, comm.local[i]):
                comm._turn.acquire()
                try:
                    work[i]()
                except BaseException as exc:
                    errors.append((comm.local[i], exc))
                    comm.abort(exc)
                finally:
                    comm._turn.release()
        finally:
            done[i].set()

    threads = [threading.Thread(target=body, args=(i,), name=f"ipuxl-replica-{r}", daemon=True)
               for i, r in enumerate(comm.local)]
    try:
        for t in threads:
            t.start()  # waits for the thread to start: Ctrl-C may land here
        go.set()
        _wait_for(done, threads)
    except BaseException as interruption:  # Ctrl-C (KeyboardInterrupt) in the calling thread
        if not go.is_set():  # some threads may not exist yet: none has run, none will
            cancelled.append(True)
            go.set()
            raise
        go.set()  # again, in case the interruption fell between setting the flag and waking the threads
        _stop_replicas(comm, done, threads, interruption)
        raise
    comm._barrier.reset()
    comm._failure = None
    if errors:
        # the first real failure, not the replicas it stopped
        _, exc = next(((r, e) for r, e in errors if not isinstance(e, ReplicaFailureError)), errors[0])
        raise exc


def _wait_for(done: Sequence[threading.Event], threads: Sequence[threading.Thread]) -> None:
    """Wait until every replica's work has returned, then for its thread to end.

    The wait is on ``done``, not ``Thread.join``: in Python 3.11 a ``join`` interrupted by
    Ctrl-C marks the thread stopped although it still runs (CPython's bpo-45274 handling
    releases the running thread's state lock), so a later ``join`` returns at once.
    """
    for event in done:
        event.wait()
    for t in threads:
        t.join()  # the thread is past its work: this is short


def _stop_replicas(comm: Communicator, done: Sequence[threading.Event], threads: Sequence[threading.Thread],
                   interruption: BaseException) -> None:
    """Stop the replica threads before an interruption of the caller leaves ``run_replicas``.

    A replica thread left running would still be inside torch's kernels when the
    interpreter exits (a program that catches Ctrl-C, saves a checkpoint and returns):
    at exit a daemon thread that takes the GIL back is ended with a forced unwind, which
    torch's C++ frames turn into an abort ("terminate called without an active exception").
    Breaking the barrier stops each replica at its next collective (one not yet started
    starts and stops there); the replica running keeps the turn until then, so this waits
    at most for the op in progress and the ops up to that collective.
    """
    comm.abort(interruption)
    _wait_for(done, threads)
    comm._barrier.reset()
    comm._failure = None
