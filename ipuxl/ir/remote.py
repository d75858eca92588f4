"""Streaming Memory in the IR: remote buffers, remote variables, replica-sharded variables.

An IPU replica has two memory spaces: on-chip SRAM and Streaming Memory (off-chip DRAM).
As in PopXL:

* a ``RemoteBuffer`` is an array of ``entries`` slots of one shape and dtype, in every
  replica's Streaming Memory (``remote_buffer(shape, dtype, entries)``);
* ``ops.remote_load(buffer, offset)`` copies slot ``offset`` on-chip, ``ops.remote_store``
  copies a tensor into a slot (``ipuxl.ops.remote``);
* a *remote variable* (``remote_variable(data, buffer, offset)``) is host data that
  initialises slot ``offset`` and that ``Session.get_tensor_data`` /
  ``write_variable_data`` / ``weights_to_host`` read and write. Its handle is a
  ``Variable`` of the pseudo graph ``streaming_memory`` (not a program graph), for the
  session's data methods: programs reach its value through ``ops.remote_load``;
* replicated tensor sharding (RTS): a tensor's flattened value, zero padded to a
  multiple of ``shard_over``, is cut into ``shard_over`` equal 1-D shards and member
  ``i`` of each group of ``shard_over`` replicas holds shard ``i``
  (``replica_sharded_buffer``, ``remote_replica_sharded_variable``, and the on-chip
  ``replica_sharded_variable``). The host always holds the full tensor (one per
  replica group of the variable's ``replica_grouping``). Shard groups are consecutive
  members of a variable's replica group: with a grouping of ``group_size`` 4 and
  ``shard_over`` 2, members 0 and 1 share one copy and members 2 and 3 another.

The device (``ipuxl.device.streaming_memory``) allocates every buffer of the IR per
replica when a ``Session`` is created, so buffers, their ``entries`` and remote
variables must be complete by then.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import torch
import torch.fx as fx

from ipuxl import dtypes
from ipuxl.dtypes import DOWNCAST, DTypeLike, check_supported, dtype_name, from_any, to_numpy_dtype
from ipuxl.errors import (
    InvalidArgumentError, InvalidValueError, ShapeMismatchError, UnsupportedError, WrongGraphError,
)
from ipuxl.ir import context
from ipuxl.ir.graph import Graph
from ipuxl.ir.graph_builder import grouped_shape, host_array
from ipuxl.ir.memmap import warn_non_const_grouping
from ipuxl.ir.ir import VariableRecord
from ipuxl.ir.meta import META_SHAPE, NAME, REMOTE, ROLE, SOURCE, Role
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor, Variable

if TYPE_CHECKING:
    from ipuxl.ir.ir import Ir

__all__ = [
    "RemoteBuffer", "remote_buffer", "replica_sharded_buffer", "remote_variable", "remote_replica_sharded_variable",
    "replica_sharded_variable", "RemoteVariable", "ShardedVariable", "RemoteVariableRecord", "TensorStorage",
    "ReplicatedTensorSharding", "TensorLocation", "remote_buffers", "remote_variable_records", "shard_size",
    "shard_grouping", "code_loaded_graphs",
]

RetrievalMode = Literal["one_per_group", "all_replicas"]


class TensorStorage(enum.Enum):
    """Where a tensor lives (PopART's ``TensorStorage``)."""

    OnChip = 0
    OffChip = 1


class ReplicatedTensorSharding(enum.Enum):
    """Whether a tensor is sharded over replicas (PopART's ``ReplicatedTensorSharding``)."""

    Off = 0
    On = 1


@dataclass(frozen=True)
class TensorLocation:
    """A tensor's memory space and sharding (PopART's ``TensorLocation``)."""

    storage: TensorStorage = TensorStorage.OnChip
    replicatedTensorSharding: ReplicatedTensorSharding = ReplicatedTensorSharding.Off  # noqa: N815 - PopART's name


# -- registries on the Ir ----------------------------------------------------------------------
def remote_buffers(ir: "Ir") -> list["RemoteBuffer"]:
    """The remote buffers of ``ir``, in creation order."""
    found: list[RemoteBuffer] = ir.__dict__.setdefault("_ipuxl_remote_buffers", [])
    return found


def remote_variable_records(ir: "Ir") -> dict[str, "RemoteVariableRecord"]:
    """The remote variables of ``ir`` by attribute name, in creation order."""
    found: dict[str, RemoteVariableRecord] = ir.__dict__.setdefault("_ipuxl_remote_variables", {})
    return found


def code_loaded_graphs(ir: "Ir") -> dict[Graph, str]:
    """Graphs whose code lives in Streaming Memory (``ops.remote_code_load``) and their destination."""
    found: dict[Graph, str] = ir.__dict__.setdefault("_ipuxl_code_loaded", {})
    return found


def _handles_graph(ir: "Ir") -> Graph:
    """The graph remote variables belong to: ``streaming_memory``, not a program graph of the IR
    (using a remote variable in an op is a ``WrongGraphError``: programs read it with ``ops.remote_load``)."""
    graph = ir.__dict__.get("_ipuxl_remote_handles")
    if graph is None:
        graph = ir.__dict__["_ipuxl_remote_handles"] = Graph(ir, "streaming_memory")
    return cast(Graph, graph)




# -- buffers ------------------------------------------------------------------------------------
class RemoteBuffer:
    """``entries`` slots of ``tensor_shape`` x ``tensor_dtype`` in every replica's Streaming Memory.

    PopXL's ``RemoteBuffer``: made in the current graph's IR; ``entries`` and ``meta_shape``
    may be changed until a ``Session`` is created (popxl.addons grows ``entries``).
    A replica-sharded buffer (``replica_sharded_buffer``) holds one shard per slot:
    ``tensor_shape`` is the shard's, ``meta_shape`` the full tensor's.

    Args:
        tensor_shape: the shape of one slot.
        tensor_dtype: the dtype of every slot.
        entries: the number of slots (>= 1).
    """

    def __init__(self, tensor_shape: tuple[int, ...], tensor_dtype: DTypeLike, entries: int = 1) -> None:
        self._ir = context.gcg().ir
        self._remote_buffer_id = len(remote_buffers(self._ir)) + 1  # PopXL numbers an Ir's buffers from 1
        self._meta_shape: tuple[int, ...] = ()
        self.shard_over: int | None = None
        """ipuxl: replicas one slot's full tensor is sharded over (``replica_sharded_buffer``; None: not
        recorded, e.g. a buffer whose ``meta_shape`` was set by hand)."""
        self.replica_grouping: ReplicaGrouping | None = None
        """ipuxl: the grouping a sharded buffer's shards were laid out for (None: all replicas)."""
        self.set_remote_buffer_info(tensor_dtype, tensor_shape, entries)
        remote_buffers(self._ir).append(self)

    def set_remote_buffer_info(self, tensor_dtype: DTypeLike, tensor_shape: tuple[int, ...], entries: int) -> None:
        """Set the slot dtype and shape and the number of entries (PopXL's)."""
        shape = tuple(tensor_shape)
        if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
            raise InvalidArgumentError(f"remote buffer: tensor_shape must be non-negative ints, got {tensor_shape!r}",
                                       where=context.user_source_line(), fix="e.g. remote_buffer((4, 8), float32)")
        self._tensor_shape = tuple(int(d) for d in shape)
        self._tensor_dtype = dtypes.public(dtypes.from_any(tensor_dtype))
        self.entries = entries

    @property
    def remote_buffer_id(self) -> int:
        """The buffer's id: 1, 2, ... in the order the Ir's buffers were made (PopXL's)."""
        return self._remote_buffer_id

    @property
    def ir(self) -> "Ir":
        return self._ir

    @property
    def _current_ir(self) -> "Ir":
        """The Ir the buffer belongs to, under PopXL's attribute name."""
        return self._ir

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        return self._tensor_shape

    @tensor_shape.setter
    def tensor_shape(self, _: Any) -> None:
        raise AttributeError("can't set attribute")  # PopXL: change it with set_remote_buffer_info

    @property
    def tensor_dtype(self) -> "dtypes.dtype":
        return self._tensor_dtype

    @tensor_dtype.setter
    def tensor_dtype(self, _: Any) -> None:
        raise AttributeError("can't set attribute")

    @property
    def entries(self) -> int:
        return self._entries

    @entries.setter
    def entries(self, value: int) -> None:
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise InvalidValueError(f"Entries must be a non-zero, positive integer: remote buffer "
                                    f"{self._remote_buffer_id} got {value!r}", where=context.user_source_line(),
                                    fix="give the number of tensors the buffer holds, e.g. entries=4")
        self._entries = int(value)

    @property
    def meta_shape(self) -> tuple[int, ...]:
        """The full (unsharded) shape of a sharded buffer's tensors; ``()`` otherwise."""
        return self._meta_shape

    @meta_shape.setter
    def meta_shape(self, shape: tuple[int, ...]) -> None:
        self._meta_shape = tuple(int(d) for d in shape)

    @property
    def nbytes(self) -> int:
        """ipuxl: the bytes of the buffer in one replica's Streaming Memory."""
        return self._entries * math.prod(self._tensor_shape) * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtypes.from_any(self._tensor_dtype)

    def validate_tensor_matches_buffer(self, t: Tensor, num_shards: int = 1) -> None:
        """Raise ``ShapeMismatchError`` (a ValueError, as PopXL's) unless ``t`` fits one slot.

        ``num_shards`` > 1: ``t`` is a full tensor whose shards fit the slot.
        """
        shape = tuple(t.shape)
        if num_shards > 1:
            shape = (shard_size(math.prod(shape), num_shards),)
        if shape != self._tensor_shape or t.dtype != self._tensor_dtype:
            raise ShapeMismatchError(
                f"Tensor does not match buffer. Tensor '{t.name}' ({shape} {dtype_name(t.dtype)}"
                f"{f', sharded over {num_shards}' if num_shards > 1 else ''}) does not match remote buffer "
                f"{self._remote_buffer_id} ({self._tensor_shape} {dtype_name(self._tensor_dtype)})",
                where=context.user_source_line(),
                fix="use a buffer made for this tensor: remote_buffer(t.shape, t.dtype, entries)")

    def check_offset(self, offset: int, what: str) -> None:
        """ipuxl: raise ``InvalidValueError`` unless ``0 <= offset < entries``."""
        if not isinstance(offset, (int, np.integer)) or isinstance(offset, bool) or not 0 <= offset < self._entries:
            raise InvalidValueError(
                f"{what}: offset {offset!r} is out of range for remote buffer {self._remote_buffer_id} with "
                f"{self._entries} entr{'y' if self._entries == 1 else 'ies'}", where=context.user_source_line(),
                fix=f"use an offset in [0, {self._entries}), or create the buffer with more entries")

    def __repr__(self) -> str:
        sharded = f", meta_shape={self._meta_shape}, shard_over={self.shard_over}" if self._meta_shape else ""
        return (f"RemoteBuffer[id={self._remote_buffer_id} {self._tensor_shape} {dtype_name(self._tensor_dtype)} "
                f"x {self._entries}{sharded}]")


def remote_buffer(tensor_shape: tuple[int, ...], tensor_dtype: DTypeLike, entries: int = 1) -> RemoteBuffer:
    """A ``RemoteBuffer`` of ``entries`` slots of ``tensor_shape`` x ``tensor_dtype`` (PopXL's).

    Example:
        >>> with ir.main_graph:
        ...     buffer = ipuxl.remote_buffer((2, 3), ipuxl.float32, entries=4)
    """
    return RemoteBuffer(tuple(tensor_shape), tensor_dtype, entries)


def shard_size(nelms: int, shard_over: int) -> int:
    """Elements of one shard: ``ceil(nelms / shard_over)`` (the last shard is zero padded)."""
    return -(-nelms // shard_over)


def _sharding(what: str, grouping: ReplicaGrouping | None, shard_over: int | None) -> tuple[ReplicaGrouping, int]:
    """The variable grouping (default: all replicas) and ``shard_over`` (default: its group size), checked."""
    ir = context.gcg().ir
    if grouping is None:
        grouping = ir.replica_grouping()
    elif not isinstance(grouping, ReplicaGrouping):
        raise InvalidArgumentError(f"{what}: replica_grouping must be a ReplicaGrouping, got {type(grouping).__name__}",
                                   where=context.user_source_line(), fix="make one with ir.replica_grouping(...)")
    shard_over = grouping.group_size if shard_over is None else shard_over
    if (not isinstance(shard_over, (int, np.integer)) or isinstance(shard_over, bool) or shard_over < 1
            or grouping.group_size % shard_over):
        raise InvalidValueError(
            f"{what}: shard_over={shard_over!r} must be a positive int dividing the replica group size "
            f"{grouping.group_size} ({grouping})", where=context.user_source_line(),
            fix=f"use shard_over among {[d for d in range(1, grouping.group_size + 1) if grouping.group_size % d == 0]}")
    if shard_over > 1 and not grouping.is_const:
        raise UnsupportedError(f"{what}: sharding over a replica grouping without one stride ({grouping})",
                               where=context.user_source_line(), fix="use ir.replica_grouping(stride, group_size)")
    return grouping, int(shard_over)


def shard_grouping(grouping: ReplicaGrouping, shard_over: int) -> ReplicaGrouping:
    """The groups of replicas that hold one sharded copy: ``shard_over`` consecutive members
    of each group of ``grouping`` (the group to pass to the gathering collectives)."""
    return ReplicaGrouping(grouping.replication_factor, grouping.stride, shard_over)


def replica_sharded_buffer(tensor_shape: tuple[int, ...], dtype: DTypeLike,
                           replica_grouping: ReplicaGrouping | None = None, shard_over: int | None = None,
                           entries: int = 1) -> RemoteBuffer:
    """A remote buffer for tensors of ``tensor_shape`` sharded over ``shard_over`` replicas (PopXL's).

    As PopXL, ``tensor_shape`` is the variable's host shape: with a grouping of G > 1
    groups it leads with the group dimension, ``(G, *shape)``, and a slot holds a shard
    of one group's tensor. Each slot holds one shard, ``(ceil(nelms / shard_over),)`` of
    the per-group ``shape``, which is the buffer's ``meta_shape``. ``shard_over`` defaults
    to the group size of ``replica_grouping`` (default: all replicas).

    Raises:
        InvalidValueError: ``shard_over`` does not divide the group size.
        ShapeMismatchError: G > 1 groups and ``tensor_shape`` does not lead with G.
    """
    grouping, over = _sharding("replica_sharded_buffer", replica_grouping, shard_over)
    full = tuple(int(d) for d in tensor_shape)
    if grouping.num_groups > 1:
        if not full or full[0] != grouping.num_groups:
            raise ShapeMismatchError(
                f"replica_sharded_buffer: {grouping} has {grouping.num_groups} groups, so tensor_shape must lead with "
                f"the group dimension {grouping.num_groups}, got {full}", where=context.user_source_line(),
                fix=f"pass ({grouping.num_groups}, *shape): the host shape of a variable with one value per group")
        full = full[1:]
    buffer = RemoteBuffer((shard_size(math.prod(full), over),), dtype, entries)
    buffer.meta_shape = full
    buffer.shard_over, buffer.replica_grouping = over, grouping
    return buffer


# -- variables ------------------------------------------------------------------------------------
@dataclass
class RemoteVariableRecord(VariableRecord):
    """A remote variable: its host data (full tensors, one per group) and its buffer slot."""

    buffer: RemoteBuffer | None = None
    offset: int = 0


class _HostShaped(Variable):
    """A variable whose host data is the full tensor while a replica may hold a shard of it."""

    __slots__ = ()

    @property
    def shape_on_host(self) -> tuple[int, ...]:
        """The host data's shape: the full tensor (``meta_shape`` when sharded), per group when several
        (PopXL's, whatever the retrieval mode: ``get_tensor_data`` of an ``all_replicas`` variable
        returns a row per replica)."""
        full = self.meta_shape or self.shape
        groups = self.replica_grouping.num_groups
        return (groups, *full) if groups > 1 else full

    @property
    def shard_over(self) -> int:
        """ipuxl: replicas the value is sharded over (1: not sharded)."""
        return self._record.shard_over or 1


class ShardedVariable(_HostShaped):
    """An on-chip replica-sharded variable (``replica_sharded_variable``): each replica holds
    its 1-D shard (``shape``); the host holds the full tensor (``meta_shape``)."""

    __slots__ = ()

    @property
    def location(self) -> TensorLocation:
        return TensorLocation(TensorStorage.OnChip, ReplicatedTensorSharding.On)


class RemoteVariable(_HostShaped):
    """A variable in Streaming Memory (``remote_variable``, ``remote_replica_sharded_variable``).

    Use it with the session's data methods; programs read it with ``ops.remote_load``.
    """

    __slots__ = ()

    @property
    def _record(self) -> RemoteVariableRecord:
        return remote_variable_records(self.ir)[str(self._node.target)]

    @property
    def remote_buffer(self) -> RemoteBuffer:
        buffer = self._record.buffer
        assert buffer is not None
        return buffer

    @property
    def offset(self) -> int:
        return self._record.offset

    @property
    def location(self) -> TensorLocation:
        rts = ReplicatedTensorSharding.On if self._record.shard_over else ReplicatedTensorSharding.Off
        return TensorLocation(TensorStorage.OffChip, rts)


def _leaf(node: fx.Node, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    node.meta[NAME] = name
    node.meta[ROLE] = Role.VARIABLE
    node.meta[SOURCE] = context.user_source_line()


def _attr(name: str) -> str:
    ident = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return ident if ident and not ident[0].isdigit() else f"v_{ident}"


def _main_graph(what: str, name: str | None) -> Any:
    graph = context.gcg()
    if not graph.is_main:
        raise WrongGraphError(
            f"{what} '{name or 'variable'}' created in subgraph '{graph.name}': variables can only be created in "
            "the main graph", where=context.user_source_line(),
            fix="create it under `with ir.main_graph:` and pass loaded values to subgraphs as inputs")
    return graph


def _full_shape(array: np.ndarray, ir: "Ir", name: str, grouping: ReplicaGrouping | None,
                retrieval_mode: str | None, sharded: bool) -> tuple[int, ...]:
    if sharded and retrieval_mode == "all_replicas" and ir.replication_factor > 1:
        raise UnsupportedError(f"variable '{name}': retrieval_mode='all_replicas' of a replica-sharded variable "
                               "(its host data is the full tensor of each group)", where=context.user_source_line(),
                               fix="use retrieval_mode='one_per_group'")
    return grouped_shape(ir, name, array.shape, grouping, retrieval_mode)


def _check_buffer(what: str, buffer: Any, ir: "Ir") -> RemoteBuffer:
    if not isinstance(buffer, RemoteBuffer):
        raise InvalidArgumentError(f"{what}: remote_buffer must be a RemoteBuffer, got {type(buffer).__name__}",
                                   where=context.user_source_line(), fix="make one with ipuxl.remote_buffer(...)")
    if buffer.ir is not ir:
        raise WrongGraphError(f"{what}: {buffer} belongs to another Ir", where=context.user_source_line(),
                              fix="create the buffer under a graph of this Ir")
    return buffer


def _new_remote_variable(what: str, data: Any, buffer: Any, offset: int, dtype: DTypeLike | None, name: str | None,
                         downcast: bool, grouping: ReplicaGrouping | None, retrieval_mode: str | None,
                         shard_over: int | None, log2_scale: int | None = None,
                         nan_on_overflow: bool | None = None) -> RemoteVariable:
    """A remote variable; ``shard_over``: None for a plain one, else the RTS shard count (1: a flat slot)."""
    graph = _main_graph(what, name)
    ir = graph.ir
    buffer = _check_buffer(what, buffer, ir)
    buffer.check_offset(offset, f"{what} '{name or 'variable'}'")
    array, torch_dtype = host_array(data, dtype, downcast, f"{what} '{name or 'variable'}'", keep_memmap=True,
                                    log2_scale=log2_scale, nan_on_overflow=nan_on_overflow)
    warn_non_const_grouping(data, grouping)
    full = _full_shape(array, ir, name or "variable", grouping, retrieval_mode, shard_over is not None)
    if (not shard_over and full == (1, *buffer.tensor_shape)
            and (grouping is None or grouping.num_groups == 1)):
        # one group's data stacked on its group axis of size 1 (as for several groups): PopXL takes it
        array = array.reshape(buffer.tensor_shape)
        full = buffer.tensor_shape
    slot = (shard_size(math.prod(full), shard_over),) if shard_over else full
    if slot != buffer.tensor_shape or dtypes.public(torch_dtype) != buffer.tensor_dtype:
        sharded = f" sharded over {shard_over} replicas: {slot}" if shard_over else ""
        raise ShapeMismatchError(
            f"{what} '{name or 'variable'}': data {full} {dtype_name(torch_dtype)}{sharded} does not match "
            f"{buffer}", where=context.user_source_line(),
            fix="create the buffer for the variable: remote_buffer(shape, dtype, entries)"
                + (" or replica_sharded_buffer(shape, dtype, replica_grouping, shard_over)" if shard_over else ""))
    records = remote_variable_records(ir)
    taken = next((r for r in records.values() if r.buffer is buffer and r.offset == offset), None)
    if taken is not None:
        raise InvalidValueError(f"{what} '{name or 'variable'}': entry {offset} of {buffer} already holds remote "
                                f"variable '{taken.tensor.name}'", where=context.user_source_line(),
                                fix=f"use another offset, or a buffer with more entries (buffer.entries = ...)")
    attr = ir.unique_name(set(records) | set(ir.variable_records), _attr(name or "remote_variable"))
    handles = _handles_graph(ir)
    node = handles.fx.get_attr(attr)
    _leaf(node, slot, torch_dtype, context.scoped_name(name or attr))
    node.meta[REMOTE] = buffer
    if shard_over:
        node.meta[META_SHAPE] = full
    tensor = handles.wrap(node, RemoteVariable)
    records[attr] = RemoteVariableRecord(tensor, array, grouping, retrieval_mode or "one_per_group",
                                         shard_over, buffer, int(offset))
    return tensor


def remote_variable(data: Any, remote_buffer: RemoteBuffer, offset: int = 0, dtype: DTypeLike | None = None,
                    name: str | None = None, downcast: bool = True, replica_grouping: ReplicaGrouping | None = None,
                    retrieval_mode: RetrievalMode | None = "one_per_group", log2_scale: int | None = None,
                    nan_on_overflow: bool | None = None) -> RemoteVariable:
    """A variable stored in entry ``offset`` of ``remote_buffer`` (PopXL's ``remote_variable``).

    Every replica's slot starts with ``data`` (one value per group of ``replica_grouping``,
    stacked on a leading axis, when it has several groups). Load it with
    ``ops.remote_load(remote_buffer, offset)``.

    Raises:
        WrongGraphError: outside the main graph.
        ShapeMismatchError: the data does not match the buffer's shape and dtype.
        InvalidValueError: the offset is out of range or already holds a variable.

    Example:
        >>> with ir.main_graph:
        ...     buffer = ipuxl.remote_buffer((2,), ipuxl.float32, entries=2)
        ...     w = ipuxl.remote_variable(np.ones(2, np.float32), buffer, 1)
        ...     loaded = ops.remote_load(buffer, 1)
    """
    return _new_remote_variable("remote_variable", data, remote_buffer, offset, dtype, name, downcast,
                                replica_grouping, retrieval_mode, None, log2_scale, nan_on_overflow)


def remote_replica_sharded_variable(data: Any, remote_buffer: RemoteBuffer, offset: int = 0,
                                    dtype: DTypeLike | None = None, name: str | None = None, downcast: bool = True,
                                    replica_grouping: ReplicaGrouping | None = None, shard_over: int | None = None,
                                    retrieval_mode: RetrievalMode | None = "one_per_group",
                                    log2_scale: int | None = None, nan_on_overflow: bool | None = None) -> RemoteVariable:
    """A variable sharded over replicas and stored in ``remote_buffer`` (PopXL's).

    The host data is the full tensor (per group); replica ``r`` stores its shard (see the
    module docstring) in slot ``offset``. ``shard_over`` defaults to the buffer's.
    """
    _main_graph("remote_replica_sharded_variable", name)
    buffer = _check_buffer("remote_replica_sharded_variable", remote_buffer, context.gcg().ir)
    if shard_over is None:
        shard_over = buffer.shard_over if buffer.shard_over is not None else _inferred_shard_over(buffer,
                                                                                                 replica_grouping)
    _, over = _sharding("remote_replica_sharded_variable", replica_grouping, shard_over)
    if not buffer.meta_shape:  # PopXL records the full shape on the buffer, for ops.remote_load
        array, _ = host_array(data, dtype, downcast, f"remote_replica_sharded_variable '{name or 'variable'}'",
                              keep_memmap=True, log2_scale=log2_scale, nan_on_overflow=nan_on_overflow)
        grouped = replica_grouping is not None and replica_grouping.num_groups > 1
        buffer.meta_shape = array.shape[1:] if grouped else array.shape
    return _new_remote_variable("remote_replica_sharded_variable", data, buffer, offset, dtype, name, downcast,
                                replica_grouping, retrieval_mode, over, log2_scale, nan_on_overflow)


def _inferred_shard_over(buffer: RemoteBuffer, grouping: ReplicaGrouping | None) -> int | None:
    """For a buffer given a ``meta_shape`` by hand: the shard count its slot fits (None: the group size)."""
    if not buffer.meta_shape or len(buffer.tensor_shape) != 1:
        return None
    size = (grouping or context.gcg().ir.replica_grouping()).group_size
    nelms = math.prod(buffer.meta_shape)
    fitting = [d for d in range(size, 0, -1) if size % d == 0 and shard_size(nelms, d) == buffer.tensor_shape[0]]
    return fitting[0] if fitting else None


def replica_sharded_variable(data: Any, dtype: DTypeLike | None = None, name: str | None = None,
                             downcast: bool = True, replica_grouping: ReplicaGrouping | None = None,
                             shard_over: int | None = None,
                             retrieval_mode: RetrievalMode | None = "one_per_group", log2_scale: int | None = None,
                             nan_on_overflow: bool | None = None) -> tuple[Variable, Tensor]:
    """An on-chip variable sharded over replicas (PopXL's ``replica_sharded_variable``).

    Returns ``(variable, shard)``: in PopXL the first is the full variable for the session's
    data methods and the second the replica's shard for the program. Here both are the
    same ``ShardedVariable``: shape ``(ceil(nelms / shard_over),)``, ``meta_shape`` the
    full shape; the host data is the full tensor (per group). Gather it with
    ``ops.collectives.replicated_all_gather(shard, group=shard_grouping(...))``.
    """
    graph = _main_graph("replica_sharded_variable", name)
    ir = graph.ir
    grouping, over = _sharding("replica_sharded_variable", replica_grouping, shard_over)
    array, torch_dtype = host_array(data, dtype, downcast, f"replica_sharded_variable '{name or 'variable'}'",
                                    keep_memmap=True, log2_scale=log2_scale, nan_on_overflow=nan_on_overflow)
    full = _full_shape(array, ir, name or "variable", replica_grouping, retrieval_mode, True)
    attr = ir.unique_name(set(ir.variable_records) | set(graph.constant_data) | set(remote_variable_records(ir)),
                          _attr(name or "variable"))
    node = graph.fx.get_attr(attr)
    _leaf(node, (shard_size(math.prod(full), over),), torch_dtype, context.scoped_name(name or attr))
    node.meta[META_SHAPE] = full
    tensor = graph.wrap(node, ShardedVariable)
    record = ir.record_variable(attr, tensor, array, replica_grouping, retrieval_mode or "one_per_group")
    record.shard_over = over
    return tensor, tensor
