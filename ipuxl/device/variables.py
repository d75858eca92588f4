"""The variables of a compiled IR, held twice as on an IPU: host buffers and device storage.

Host buffers are numpy arrays, one per variable: the variable's value, or for a variable
with one value per replica group (``retrieval_mode`` ``"one_per_group"``) or per replica
(``"all_replicas"``) one row each (PopXL's rule). Device storage is one dict of torch
tensors per local replica (attribute name -> tensor), which the compiled program reads
and updates in place. Remote variables (Streaming Memory) live in ``StreamingMemory``.

``DeviceVariables`` copies between the two (``to_host``, ``from_host``), checks and
applies user writes, and binds caller-owned tensors as device storage. When to sync
(attached or not, host in sync or not) is the session's business.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, cast

import numpy as np
import torch

from ipuxl.device.replica_plan import ReplicaPlan
from ipuxl.device.streaming_memory import StreamingMemory, flush_memmaps, initial_value, read_host, write_device
from ipuxl import fp8_utils
from ipuxl.dtypes import dtype_name, to_numpy_dtype
from ipuxl.errors import InvalidArgumentError, ShapeMismatchError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.ir import Ir, VariableRecord
from ipuxl.ir.meta import SOURCE
from ipuxl.ir.remote import RemoteVariable
from ipuxl.ir.tensor import Constant, Tensor, Variable

__all__ = ["DeviceVariables", "attr_of", "constant_value"]


_UNBOUND = torch.empty(0)  # a place kept for caller-given storage while it is checked and bound

class DeviceVariables:
    """Host buffers and per-replica device storage of an IR's variables.

    Args:
        ir: the program.
        plan: which replicas run in this process and their initial values.
        device: where device storage lives.
        created_at: where the session was created (for errors about later IR changes).
        storage: tensors to use as the first local replica's storage of some variables.
    """

    def __init__(self, ir: Ir, plan: ReplicaPlan, device: torch.device, created_at: str | None,
                 storage: Mapping[Variable, torch.Tensor] | None = None):
        self.ir = ir
        self.device = device
        self._plan = plan
        self._num_replicas = ir.replication_factor
        self._created_at = created_at
        records = ir.variable_records
        self.records = {r.tensor: r for r in records.values()}
        self.host = _HostBuffers(lambda tensor: self._initial_host(self.records[tensor]))
        """Each variable's host buffer, made on first use (``_HostBuffers``)."""
        self.memory = StreamingMemory(ir, plan, device)  # remote buffers (device.streaming_memory)
        given = storage or {}
        bound = {id(t) for t in given}  # their first local replica's storage is bound below, never copied
        self.replicas: list[dict[str, torch.Tensor]] = [
            {attr: _UNBOUND if i == 0 and id(r.tensor) in bound
             else self._to_device(initial_value(plan, r, replica), r.tensor.spec.dtype)
             for attr, r in records.items()} for i, replica in enumerate(plan.local)]
        """Device storage, one dict per local replica (``plan.local`` order): attribute -> tensor."""
        for tensor, given_tensor in given.items():  # zero-copy: this replica's storage is the caller's tensor
            self.replicas[0][attr_of(tensor)] = self.bound_storage(tensor, given_tensor)

    # -- binding caller-owned storage ----------------------------------------------------
    def bound_storage(self, tensor: Variable, given: torch.Tensor) -> torch.Tensor:
        """``given`` as the device storage of ``tensor`` (first local replica), checked."""
        self.check_own(tensor, (Variable,), "Session(storage=...)")
        if self.records[tensor].grouping is not None and self.records[tensor].replica_grouping(
                self.ir.replication_factor).num_groups > 1:
            raise InvalidArgumentError(
                f"Session(storage=...): variable '{tensor.name}' has one value per replica group",
                fix="give storage only for variables with one value")
        if (tuple(given.shape), given.dtype, given.device) != (tensor.shape, tensor.dtype, self.device) \
                or not given.is_contiguous():
            raise InvalidArgumentError(
                f"Session(storage=...): the tensor for variable '{tensor.name}' is {tuple(given.shape)} "
                f"{dtype_name(given.dtype)} on {given.device}"
                f"{'' if given.is_contiguous() else ', not contiguous'}; the variable needs a contiguous "
                f"{tensor.shape} {dtype_name(tensor.dtype)} tensor on {self.device}",
                fix="give a matching tensor, or leave the variable out of storage (the session then owns a copy)")
        return given.detach()  # shares storage and version counter; attaching writes the variable's data into it

    def bind(self, tensor: Variable, given: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Make ``given`` the first local replica's storage of ``tensor``; its attribute and storage."""
        storage = self.bound_storage(tensor, given)
        attr = attr_of(tensor)
        self.replicas[0][attr] = storage
        return attr, storage

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return fp8_utils.to_tensor(np.array(array, copy=True)).to(self.device, dtype)

    # -- which replica each host row belongs to ---------------------------------------------
    def _host_replicas(self, record: VariableRecord) -> list[int] | None:
        """The replica behind each row of a variable's host buffer (None: the buffer is one value).

        PopXL's rule: "one_per_group" keeps one value per group of the variable's
        replica grouping (the group's first replica), "all_replicas" one per replica.
        """
        replicas = self._num_replicas
        if record.retrieval_mode == "all_replicas" and replicas > 1:
            return list(range(replicas))
        grouping = record.replica_grouping(replicas)
        return [members[0] for members in grouping.groups] if grouping.num_groups > 1 else None

    def _initial_host(self, record: VariableRecord) -> np.ndarray:
        rows = self._host_replicas(record)
        if isinstance(record.data, np.memmap) and (
                rows is None or (record.retrieval_mode == "one_per_group" and len(record.data) == len(rows))):
            return record.data  # the variable's host value lives in its file (``ipuxl.variable`` kept the memmap)
        if rows is None:
            return np.array(record.data, copy=True)
        return np.stack([self._plan.initial_value(record, r) for r in rows])

    def _host_row(self, record: VariableRecord, replica: int) -> int | None:
        """Which row of the host buffer replica ``replica`` is loaded from."""
        replicas = self._num_replicas
        if record.retrieval_mode == "all_replicas" and replicas > 1:
            return replica
        grouping = record.replica_grouping(replicas)
        return grouping.assignment[replica] if grouping.num_groups > 1 else None

    def _local_member(self, record: VariableRecord, replica: int) -> int | None:
        """``replica`` if it runs here, else (one_per_group) a member of its group that does."""
        local = set(self._plan.local)
        if replica in local:
            return replica
        if record.retrieval_mode == "all_replicas":
            return None
        members = record.replica_grouping(self._num_replicas).members(replica)
        return next((m for m in members if m in local), None)

    def _read_elsewhere(self) -> list[Variable]:
        """The on-chip variables whose host value needs replicas of other processes (torchrun):
        sharded ones, and grouped ones with a group (or, for "all_replicas", a replica) that
        has no member here."""
        found = []
        for tensor, record in self.records.items():
            rows = self._host_replicas(record)
            if record.shard_over or (rows is not None and any(self._local_member(record, r) is None for r in rows)):
                found.append(tensor)
        return found

    def gather_elsewhere(self, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After a run under torchrun: gather (``gather``: across processes) the values of the
        variables held only in other processes (shards, groups), for host reads."""
        self.memory.gather_shards(gather, {t: [v[attr_of(t)] for v in self.replicas] for t in self._read_elsewhere()})

    # -- copies between host and device ---------------------------------------------------------
    def to_host(self) -> None:
        """Copy every variable from the device to its host buffer (see ``Session.weights_to_host``)."""
        local = self._plan.local
        for tensor in self.records:
            record, attr, host = self.records[tensor], attr_of(tensor), self.host[tensor]
            if record.shard_over:  # full tensors from the replicas' shards (device.streaming_memory)
                read_host(record, host, self._num_replicas,
                          lambda r: self.replicas[local.index(r)][attr] if r in local
                          else self.memory.elsewhere(tensor, r))
                continue
            rows = self._host_replicas(record)
            if rows is None:
                value = self.replicas[0][attr].detach().to("cpu")
                host[...] = fp8_utils.to_host(value)
                continue
            for row, replica in enumerate(rows):
                source = self._local_member(record, replica)
                held = self.replicas[local.index(source)][attr] if source is not None \
                    else self.memory.elsewhere(tensor, replica)
                if held is not None:
                    value = held.detach().to("cpu")
                    host[row] = fp8_utils.to_host(value)
        self.memory.to_host()
        flush_memmaps(self.host.values())

    def from_host(self) -> None:
        """Copy every variable's host buffer to the device (each replica its row)."""
        for tensor, record in self.records.items():
            # a buffer never made still holds the initial value: load that, without making it
            initial = tensor not in self.host and self._host_replicas(record) is None
            self._load_replicas(tensor, record.data if initial else self.host[tensor])
        self.memory.from_host()

    def _load_replicas(self, tensor: Variable, host: np.ndarray) -> None:
        record, attr = self.records[tensor], attr_of(tensor)
        for replica, variables in zip(self._plan.local, self.replicas):
            if record.shard_over:  # each replica its shard (device.streaming_memory)
                write_device(record, host, self._num_replicas, replica, variables[attr])
                self.memory.forget_gathered(tensor)  # torchrun: other processes' shards are pre-write
                continue
            row = self._host_row(record, replica)
            variables[attr].copy_(fp8_utils.to_tensor(np.asarray(host if row is None else host[row])))  # a 0-d row too
            self.memory.forget_gathered(tensor)  # torchrun: other processes' values are pre-write

    # -- user reads and writes ------------------------------------------------------------------
    def host_of(self, tensor: Variable) -> np.ndarray:
        """The host buffer of an on-chip or remote variable."""
        return self.memory.host[tensor] if isinstance(tensor, RemoteVariable) else self.host[tensor]

    def write(self, arrays: Mapping[Variable, np.ndarray], attached: bool) -> None:
        """Set the host buffers of checked ``arrays`` (``checked_data``), and the device's when ``attached``."""
        for tensor, array in arrays.items():
            self.host_of(tensor)[...] = array
            if attached and isinstance(tensor, RemoteVariable):
                self.memory.from_host([tensor])
            elif attached:
                self._load_replicas(tensor, self.host[tensor])

    def checked_data(self, tensor: Variable, data: Any) -> np.ndarray:
        """``data`` for ``tensor`` as an array, checked against its dtype and host shape."""
        self.check_own(tensor, (Variable,), "write_variables_data")
        array = np.asarray(data)
        expected = to_numpy_dtype(tensor.dtype)
        if array.dtype != expected and not (array.ndim == 0 and np.isscalar(data)):
            raise InvalidArgumentError(
                f"write_variables_data: data for variable '{tensor.name}' has dtype {array.dtype}, "
                f"the variable is {dtype_name(tensor.dtype)}", fix=f"convert with .astype(np.{expected})")
        expected_shape = self.host_of(tensor).shape
        if array.shape != expected_shape:
            per = "replica" if tensor.retrieval_mode == "all_replicas" else "replica group"
            rows = "" if expected_shape == (tensor.meta_shape or tensor.shape) else \
                f" ({expected_shape[0]} rows: one per {per})"
            raise ShapeMismatchError(
                f"write_variables_data: data for variable '{tensor.name}' has shape {array.shape}, "
                f"the variable's host data has shape {expected_shape}{rows}",
                fix="reshape the data to the variable's host shape")
        return array

    def check_own(self, tensor: Any, kinds: tuple[type[Tensor], ...], what: str) -> None:
        """Refuse ``tensor`` unless it is one of ``kinds`` and a variable or constant of this
        IR that the session compiled (``what``: the API call, for the message)."""
        if not isinstance(tensor, kinds):
            # PopXL's sentences: ``get_tensor_data`` and ``write_variable_data`` name what they support
            kind, api = ("Constant or Variable", "get_tensor_data") if len(kinds) > 1 else ("Variable", "write_variable_data")
            shown = f"Tensor {tensor.id}" if isinstance(tensor, Tensor) else repr(tensor)
            raise InvalidArgumentError(
                f"{shown} is not of type {kind}. {api} is not supported for this type ({what})",
                fix="pass tensors created with ipuxl.variable (or ipuxl.constant)")
        if tensor.graph.ir is not self.ir:
            raise InvalidArgumentError(
                f"{what}: tensor '{tensor.name}' belongs to another Ir than this session's",
                fix="copy values between IRs with session_a.get_tensors_data + session_b.write_variables_data")
        if isinstance(tensor, Variable) and tensor not in self.records and tensor not in self.memory.records:
            raise InvalidArgumentError(
                f"{what}: variable '{tensor.name}' was added to the IR after this Session was created "
                f"(at {self._created_at}), so the session's compiled program does not have it",
                where=tensor.node.meta.get(SOURCE) or user_source_line(),
                fix="create a new Session after changing the IR: a Session compiles the IR once, when it is created")


class _HostBuffers(dict):
    """Host buffers made on first use: a copy of the variable's initial value (its IR data).

    Until a program's variables are read back or written from the host, its session holds
    no second host copy of them (a model's weights and optimiser state: as much memory as
    the device copies). A buffer never made holds, by definition, the initial value.
    """

    def __init__(self, make: Callable[[Variable], np.ndarray]):
        super().__init__()
        self._make = make

    def __missing__(self, tensor: Variable) -> np.ndarray:
        made = self[tensor] = self._make(tensor)
        return made


def attr_of(tensor: Variable | Constant) -> str:
    """The ``get_attr`` target that names a variable's or constant's storage."""
    return cast(str, tensor.node.target)


def constant_value(tensor: Constant) -> np.ndarray:
    """A constant's value as a numpy array (bfloat16 as float32)."""
    value = tensor.graph.constant_data[attr_of(tensor)]
    return fp8_utils.to_host(value)
