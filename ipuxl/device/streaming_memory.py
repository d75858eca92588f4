"""The device's Streaming Memory: every replica's remote buffers, and host data in PopXL's layout.

Each local replica owns one tensor per remote buffer of the IR, ``(entries, *slot shape)``
(``ipuxl.ir.remote``), allocated when the ``Session`` is created. While the session runs
a replica, ``running(index)`` installs that replica's buffers for the remote kernels
(``ipuxl.kernels.remote``).

Remote variables keep a host buffer like on-chip variables: the full value per replica
group (``retrieval_mode="one_per_group"``) or per replica (``"all_replicas"``).
Replica-sharded ones (remote or on-chip, ``VariableRecord.shard_over``) hold the full
tensor on the host and each replica's shard on the device: member ``i`` of a shard
group gets the ``i``-th 1-D shard of the flattened, zero-padded value; reading gathers
the shards of the group's first ``shard_over`` members. Under torchrun every run ends by
gathering all replicas' shards of the sharded variables into every process
(``gather_shards``), so each process reads the full tensors; a write from the host
(``write_variable_data``, ``weights_from_host``) drops those gathered shards, so until
the next run the host keeps the written value instead of mixing in shards from before
the write. Before any run nothing is gathered and the host holds the initial value.
An unsharded host row whose replicas all run in other processes keeps its last value
(as for on-chip variables).
"""
from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np
import torch

from ipuxl import fp8_utils

from ipuxl.errors import DeviceError
from ipuxl.ir.ir import Ir, VariableRecord
from ipuxl.ir.remote import RemoteBuffer, RemoteVariableRecord, remote_buffers, remote_variable_records, shard_size
from ipuxl.kernels.remote import streaming_memory

if TYPE_CHECKING:
    from ipuxl.device.replica_plan import ReplicaPlan
    from ipuxl.ir.tensor import Variable

__all__ = ["StreamingMemory", "initial_value", "shard", "unshard", "read_host", "replica_value", "write_device",
           "flush_memmaps"]


# -- layouts ------------------------------------------------------------------------------------------
def shard(full: np.ndarray, index: int, shard_over: int) -> np.ndarray:
    """Shard ``index`` of ``shard_over`` of ``full`` (flattened, zero padded)."""
    flat = np.ascontiguousarray(full).reshape(-1)
    size = shard_size(flat.size, shard_over)
    out = np.zeros((size,), dtype=flat.dtype)
    part = flat[index * size:(index + 1) * size]
    out[:part.size] = part
    return out


def unshard(shards: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """The full tensor of ``shape`` from its shards in order (padding dropped)."""
    return np.concatenate([s.reshape(-1) for s in shards])[:math.prod(shape)].reshape(shape)


def _group_value(record: VariableRecord, replica: int, replicas: int) -> np.ndarray:
    grouping = record.replica_grouping(replicas)
    return record.data[grouping.assignment[replica]] if grouping.num_groups > 1 else record.data


def _shard_index(record: VariableRecord, replica: int, replicas: int) -> int:
    members = record.replica_grouping(replicas).members(replica)
    return members.index(replica) % (record.shard_over or 1)


def replica_value(record: VariableRecord, full: np.ndarray, replica: int, replicas: int) -> np.ndarray:
    """What replica ``replica`` holds of its group's full value ``full``: all of it, or its shard."""
    if not record.shard_over:
        return full
    return shard(full, _shard_index(record, replica, replicas), record.shard_over)


def initial_value(plan: "ReplicaPlan", record: VariableRecord, replica: int) -> np.ndarray:
    """Replica ``replica``'s initial device value of a variable (its shard when sharded)."""
    if not record.shard_over:
        return plan.initial_value(record, replica)
    full = _group_value(record, replica, plan.replication_factor)
    return replica_value(record, full, replica, plan.replication_factor)


def _rows(record: VariableRecord, replicas: int) -> list[list[int]] | None:
    """The replicas behind each host row (the first of each list is read), None: one value."""
    if record.retrieval_mode == "all_replicas" and replicas > 1:
        return [[r] for r in range(replicas)]
    grouping = record.replica_grouping(replicas)
    return grouping.groups if grouping.num_groups > 1 else None


def _row_of(record: VariableRecord, replica: int, replicas: int) -> int | None:
    if record.retrieval_mode == "all_replicas" and replicas > 1:
        return replica
    grouping = record.replica_grouping(replicas)
    return grouping.assignment[replica] if grouping.num_groups > 1 else None


def read_host(record: VariableRecord, host: np.ndarray, replicas: int,
              value_of: Callable[[int], torch.Tensor | None]) -> None:
    """Write the device values into the host buffer ``host`` (PopXL's layout).

    ``value_of(replica)``: that replica's device tensor, None when it runs elsewhere.
    """
    rows = _rows(record, replicas)
    shape = host.shape if rows is None else host.shape[1:]
    for row, members in enumerate(rows if rows is not None else [list(range(replicas))]):
        value: np.ndarray | None = None
        if record.shard_over:
            shards = [value_of(m) for m in members[:record.shard_over]]
            if all(s is not None for s in shards):
                value = unshard([_numpy(s) for s in shards if s is not None], shape)
        else:
            local = [v for v in (value_of(m) for m in members) if v is not None]
            value = _numpy(local[0]) if local else None
        if value is not None:  # else the row keeps its last value (its replicas run in other processes)
            host[(...,) if rows is None else row] = value


def write_device(record: VariableRecord, host: np.ndarray, replicas: int, replica: int, target: torch.Tensor) -> None:
    """Copy replica ``replica``'s part of host buffer ``host`` into its device tensor ``target``."""
    row = _row_of(record, replica, replicas)
    full = host if row is None else host[row]
    value = np.array(replica_value(record, full, replica, replicas), copy=True, order="C")  # 0-d stays 0-d
    target.copy_(fp8_utils.to_tensor(value))


def host_buffer(record: VariableRecord, replicas: int) -> np.ndarray:
    """The initial host buffer of a remote or sharded variable: a private copy of its data, or
    the data itself when it is a memmap (``ir.memmap``: the file is the host buffer)."""
    if record.retrieval_mode == "all_replicas" and replicas > 1:
        return np.stack([_group_value(record, r, replicas) for r in range(replicas)])
    if isinstance(record.data, np.memmap):
        return record.data
    return np.array(record.data, copy=True)


def flush_memmaps(buffers: Iterable[np.ndarray]) -> None:
    """Write the memmapped host buffers among ``buffers`` back to their files (after ``weights_to_host``)."""
    for buffer in buffers:
        if isinstance(buffer, np.memmap):
            buffer.flush()


def _numpy(t: torch.Tensor) -> np.ndarray:
    value = t.detach().to("cpu")
    return fp8_utils.to_host(value)


# -- the Streaming Memory of a session ----------------------------------------------------------------
class StreamingMemory:
    """The remote buffers of every local replica of a session, and its remote variables' host data.

    Args:
        ir: the program (its buffers and remote variables must be complete).
        plan: which replicas this process runs.
        device: where the buffers live (the session's device).
    """

    def __init__(self, ir: Ir, plan: "ReplicaPlan", device: torch.device):
        self.replicas = plan.replication_factor
        self.local = list(plan.local)
        self.buffers: list[RemoteBuffer] = list(remote_buffers(ir))
        self._layout = [(b.remote_buffer_id, b.entries, b.tensor_shape) for b in self.buffers]
        self.records: dict["Variable", RemoteVariableRecord] = {
            r.tensor: r for r in remote_variable_records(ir).values()}
        self.stores: list[dict[int, torch.Tensor]] = [
            {b.remote_buffer_id: torch.zeros((b.entries, *b.tensor_shape), dtype=b.torch_dtype, device=device)
             for b in self.buffers} for _ in self.local]
        self.host: dict["Variable", np.ndarray] = {
            t: host_buffer(r, self.replicas) for t, r in self.records.items()}
        self.gathered: dict["Variable", torch.Tensor] = {}
        """Under torchrun: every replica's shard of each sharded variable after the last run."""
        self.from_host()

    def check_unchanged(self, ir: Ir, created_at: str | None) -> None:
        """Raise ``DeviceError`` when buffers or remote variables changed after the session was created."""
        now = [(b.remote_buffer_id, b.entries, b.tensor_shape) for b in remote_buffers(ir)]
        if now == self._layout and len(remote_variable_records(ir)) == len(self.records):
            return
        raise DeviceError(
            "the IR's remote buffers or remote variables changed after the Session was created (buffers "
            f"{len(self.buffers)} -> {len(now)}, remote variables {len(self.records)} -> "
            f"{len(remote_variable_records(ir))}, or a buffer's entries or shape): the session allocated "
            "Streaming Memory for the IR as it was", where=f"the Session was created at {created_at}",
            fix="finish the buffers (entries included) and remote variables before creating the Session")

    @property
    def nbytes(self) -> int:
        """Streaming Memory of one replica, bytes."""
        return sum(b.nbytes for b in self.buffers)

    @contextlib.contextmanager
    def running(self, index: int) -> Iterator[None]:
        """Remote ops of this thread use local replica ``index``'s buffers."""
        with streaming_memory(self.stores[index] if self.buffers else None):
            yield

    @contextlib.contextmanager
    def copy_running(self, index: int) -> Iterator[None]:
        """As ``running``, on a copy of the buffers (``device.failures`` re-runs a failed step on copies)."""
        copy = {k: v.clone() for k, v in self.stores[index].items()}
        with streaming_memory(copy if self.buffers else None):
            yield

    def _slot(self, index: int, record: RemoteVariableRecord) -> torch.Tensor:
        assert record.buffer is not None
        return self.stores[index][record.buffer.remote_buffer_id][record.offset]

    def from_host(self, tensors: "list[Variable] | None" = None) -> None:
        """Copy the host buffers of ``tensors`` (default: all) into every local replica's slots."""
        for tensor in tensors if tensors is not None else list(self.records):
            record = self.records[tensor]
            self.forget_gathered(tensor)
            for index, replica in enumerate(self.local):
                write_device(record, self.host[tensor], self.replicas, replica, self._slot(index, record))

    def gather_shards(self, gather: Callable[[torch.Tensor], torch.Tensor],
                      onchip: dict["Variable", list[torch.Tensor]]) -> None:
        """Under torchrun, after a run (every process takes part): keep every replica's shard of
        the sharded variables (``onchip``: the on-chip ones' local shards; the remote ones are
        read here), so a process can read the full tensors whose shards live in other processes.

        ``gather``: concatenates every process's tensor along axis 0 (the session's communicator).
        """
        values = dict(onchip)
        for tensor, record in self.records.items():
            if record.shard_over:
                values[tensor] = [self._slot(i, record) for i in range(len(self.local))]
        for tensor, shards in values.items():  # the same order in every process: the IR's
            self.gathered[tensor] = gather(torch.stack(shards))

    def forget_gathered(self, tensor: "Variable") -> None:
        """Drop the other processes' shards of ``tensor`` gathered after the last run: the host
        has just written it (every process writes the same, SPMD), so until the next run the
        host buffer is the value of the replicas that run elsewhere (``read_host`` keeps it)."""
        self.gathered.pop(tensor, None)

    def elsewhere(self, tensor: "Variable", replica: int) -> torch.Tensor | None:
        """Replica ``replica``'s shard of ``tensor`` as gathered after the last run (None: not known)."""
        gathered = self.gathered.get(tensor)
        return None if gathered is None else gathered[replica]

    def to_host(self) -> None:
        """Copy every remote variable's slots to its host buffer."""
        for tensor, record in self.records.items():
            def value_of(replica: int, record: RemoteVariableRecord = record,
                         tensor: "Variable" = tensor) -> torch.Tensor | None:
                if replica in self.local:
                    return self._slot(self.local.index(replica), record)
                return self.elsewhere(tensor, replica)

            read_host(record, self.host[tensor], self.replicas, value_of)
        flush_memmaps(self.host.values())
