"""Variable factories: a subgraph declares its state, the main graph creates it.

``Module.add_variable_input`` makes a graph input and a ``VariableFactory`` that can
later create a matching variable in the main graph (``NamedVariableFactories.init``),
as popxl.addons does. Variables are created in sorted key order so their initial
data is deterministic.

A factory made with ``shard_over > 1`` (``add_replica_sharded_variable_input``) is
replica sharded: its graph inputs are the flat 1-D shard ``(nelms // shard_over,)``
with the full shape as ``meta_shape``, while its host data stays whole. Such a factory
makes variables in Streaming Memory with ``init_remote`` (a replica-sharded remote
buffer holds one shard per replica), as upstream.

``init(memmap_dir=...)`` keeps each variable's host value in a memory-mapped file of
that directory (``VariableFactory.next_memmap``), so a model larger than host memory
can be initialised, and values written back by the session persist in the files.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np
import torch

import ipuxl
from ipuxl.addons_compat.dot_tree import DotTree
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.ir.graph_builder import graph_input, variable
from ipuxl.dtypes import DOWNCAST, DTypeLike, dtype_name, from_any, to_numpy_dtype
from ipuxl.errors import GraphContextError, InvalidArgumentError, PopdistError, with_builtin
from ipuxl.ir import context
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor
from ipuxl.ir.world import world
from ipuxl.ops.debug import init as _init_op

if TYPE_CHECKING:
    from ipuxl.addons_compat.remote import NamedRemoteBuffers

#: a bad data source: upstream's ValueError, and ipuxl's InvalidArgumentError (a TypeError)
_DataSourceError = with_builtin(InvalidArgumentError, ValueError)

__all__ = ["VariableFactory", "NamedVariableFactories", "add_variable_input", "add_replica_sharded_variable_input"]


class VariableFactory:
    """Creates graph inputs and main-graph variables from a data source.

    Args:
        data_iter: a callable returning host data, or an iterable of host data. A
            callable is called once here to test it (the result is discarded, as
            upstream) and then once per variable.
        dtype: the tensor dtype (default: the data's, 64-bit downcast to 32-bit).
        name: the tensor name.
        by_ref: graph inputs made by this factory are passed by reference.
        replica_grouping: which replicas share the variable's value (default, inside an
            ``Ir``: all replicas). With G > 1 groups a variable holds one value per group.
        shard_over: replicas of the grouping to shard the variable over; 1 (default)
            means not sharded. A sharded factory's ``shape`` is the 1-D shard and its
            ``meta_shape`` the whole shape.

    Raises:
        InvalidArgumentError: (also a ValueError, as upstream) a data callable that raises
            when tried, or a data source that is neither callable nor iterable.
        InvalidArgumentError: a ``shard_over`` that does not divide the data or exceeds the
            group size.
    """

    def __init__(self, data_iter: Callable[[], Any] | Iterable[Any], dtype: DTypeLike = None,
                 name: str | None = None, by_ref: bool = False, replica_grouping: Any = None,
                 shard_over: int = 1):
        if callable(data_iter):
            source = data_iter
            try:
                # Upstream calls the callable once to test it and discards the result:
                # doing the same keeps seeded host RNG draws (np.random) identical.
                source()
            except Exception as error:
                raise _DataSourceError(
                    f"Passed callable via `data_iter` throws error: the data callable of variable factory "
                    f"'{name}' raised {type(error).__name__}: {error}", where=context.user_source_line(),
                    fix="pass a callable returning host data, e.g. `partial(np.zeros, shape)`") from error

            def endless() -> Iterator[Any]:
                while True:
                    yield source()

            self._data: Iterator[Any] = endless()
        elif isinstance(data_iter, Iterable):
            self._data = iter(data_iter)
        else:
            raise _DataSourceError(
                f"`data_iter` must be an iterable or callable: variable factory '{name}' got "
                f"{type(data_iter).__name__}", where=context.user_source_line(),
                fix="wrap fixed data in a function, e.g. `lambda: data`")
        first = np.asarray(_host(next(self._data)))
        self._peeked: list[Any] = [first]
        inferred = from_any(first.dtype)
        self.dtype = from_any(dtype) if dtype is not None else DOWNCAST.get(inferred, inferred)
        self.shape: tuple[int, ...] = tuple(first.shape)
        self.meta_shape: tuple[int, ...] | None = None
        self.name = name
        self.by_ref = by_ref
        self.replica_grouping = replica_grouping if replica_grouping is not None else _all_replicas()
        self.replica_sharded = shard_over > 1
        if self.replica_sharded:
            self._check_shard_over(shard_over)
            self.meta_shape = self.shape
            self.shape = (int(np.prod(self.meta_shape)) // shard_over,)

    def _check_shard_over(self, shard_over: int) -> None:
        group_size = self.replica_grouping.group_size if self.replica_grouping is not None else None
        nelms = int(np.prod(self.shape))
        if (group_size is not None and shard_over > group_size) or nelms % shard_over:
            raise InvalidArgumentError(
                f"variable factory '{self.name}': cannot shard {nelms} elements (shape {self.shape}) over "
                f"{shard_over} replicas (replica group size {group_size})", where=context.user_source_line(),
                fix="use a shard_over that divides the element count and is at most the replica group size")

    def next_data(self, empty: bool = False) -> np.ndarray:
        """The next host value (the first one was read to learn shape and dtype), whole
        (not sharded); with G > 1 replica groups, one value per group stacked ``(G, ...)``.
        ``empty``: placeholder data of the right shape instead (upstream uses ``np.empty``;
        zeros here, so runs stay reproducible)."""
        def one() -> np.ndarray:
            if empty:
                return np.zeros(self.meta_shape or self.shape, np.float32)
            return self._peeked.pop() if self._peeked else np.asarray(_host(next(self._data)))

        groups = self.replica_grouping.num_groups if self.replica_grouping is not None else 1
        if groups == 1:
            return one()
        return np.stack([one() for _ in range(groups)])

    def create_input(self, prefix: str | None = None) -> Tensor:
        """A graph input of this factory's spec (shard and meta shape included) in the current graph."""
        name = self.name if prefix is None else f"{prefix}.{self.name}"
        return graph_input(self.shape, self.dtype, name, by_ref=self.by_ref, meta_shape=self.meta_shape)

    def next_memmap(self, memmap_dir: str, name: str, empty: bool = False,
                    read_only_if_exists: bool = False) -> np.memmap:
        """The host value as an ``np.memmap`` of ``<memmap_dir>/<name>.npy`` (raw data, no
        ``.npy`` header, as upstream), of the whole shape (``(G, ...)`` with G > 1 groups).

        A file that does not exist yet is created (instance 0 of a torchrun program; the
        others wait for it) and filled with the next host value, unless ``empty``. A file
        that exists is opened as it is, ``"r+"`` (or ``"r"`` with ``read_only_if_exists``)
        and the data source is not advanced: values saved by an earlier run are reused.
        """
        path = os.path.join(memmap_dir, name + ".npy")
        shape = self.meta_shape or self.shape
        groups = self.replica_grouping.num_groups if self.replica_grouping is not None else 1
        if groups != 1:
            shape = (groups, *shape)
        host_dtype = to_numpy_dtype(self.dtype)
        if world()[1] == 0 and not os.path.exists(path):
            os.makedirs(memmap_dir, exist_ok=True)
            partial = f"{path}.{os.getpid()}.partial"  # written whole, then renamed: readers never see half a file
            data = np.memmap(partial, dtype=host_dtype, shape=shape, mode="w+")
            if not empty:
                data[...] = self.next_data(empty)
            data.flush()
            del data
            os.replace(partial, path)
        else:
            _wait_for(path)
        return np.memmap(path, dtype=host_dtype, shape=shape, mode="r" if read_only_if_exists else "r+")

    def _host_value(self, name: str, empty: bool, memmap_dir: str | None, read_only_if_exists: bool) -> np.ndarray:
        if memmap_dir:
            return self.next_memmap(memmap_dir, name, empty, read_only_if_exists)
        return self.next_data(empty)

    def create_tensor(self, name: str | None = None, empty: bool = False, memmap_dir: str | None = None,
                      read_only_if_exists: bool = False) -> Tensor:
        """A variable in the main graph holding the next host value.

        With ``memmap_dir``, the value is a memory-mapped file there (``next_memmap``)
        and stays the variable's host value: ``Session.weights_to_host`` (and leaving a
        ``with session:`` block) writes the device's values into the file. A read-only
        map (``read_only_if_exists`` on a file that existed) gives the initial value only.
        """
        name = name or self.name
        data = self._host_value(name or "t", empty, memmap_dir, read_only_if_exists)
        return variable(data, self.dtype, name, replica_grouping=self.replica_grouping)

    def create_remote_tensor(self, buffer: Any, entry: int, name: str | None = None, empty: bool = False,
                             memmap_dir: str | None = None, read_only_if_exists: bool = False) -> Tensor:
        """A variable stored in entry ``entry`` of remote ``buffer``, holding the next host value
        (with ``memmap_dir``: read from a memory-mapped file, see ``next_memmap``; the remote
        variable's host value is a copy).

        A buffer with a ``meta_shape`` makes a replica-sharded remote variable (the host
        data is whole; each replica's Streaming Memory holds its shard), as upstream.
        """
        data = self._host_value(name or self.name or "t", empty, memmap_dir, read_only_if_exists)
        if buffer.meta_shape:
            # A buffer made by remote_buffer() with a meta shape set by hand (as upstream
            # does) records no shard count: it is the ratio of the whole to the shard.
            shard_over = int(np.prod(buffer.meta_shape)) // int(np.prod(buffer.tensor_shape))
            return ipuxl.remote_replica_sharded_variable(data, buffer, entry, self.dtype, name or self.name,
                                                         replica_grouping=self.replica_grouping,
                                                         shard_over=shard_over)
        return ipuxl.remote_variable(data, buffer, entry, self.dtype, name or self.name,
                                     replica_grouping=self.replica_grouping)

    def __repr__(self) -> str:
        return f"VariableFactory({self.name!r}, shape={self.shape}, dtype={dtype_name(self.dtype)})"


def _wait_for(path: str, timeout: float = 600.0) -> None:
    """Wait until instance 0 of a multi-process program has created ``path``."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise PopdistError(f"memory-mapped variable file '{path}' did not appear within {timeout:.0f} s",
                               where=f"instance {world()[1]} of {world()[0]}",
                               fix="check that instance 0 runs the same program and can write the directory")
        time.sleep(0.05)


def _host(data: Any) -> Any:
    return data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else data


def _all_replicas() -> ReplicaGrouping | None:
    """The current Ir's all-replicas grouping (upstream's default), or None outside an Ir."""
    try:
        return context.gcg().ir.replica_grouping()
    except GraphContextError:  # no graph being built: factories made by hand before any Ir
        return None


class NamedVariableFactories(DotTree[VariableFactory]):
    """A tree of ``VariableFactory``; ``init()`` creates the variables."""

    def init(self, prefix: str | None = None, empty: bool = False, memmap_dir: str | None = None,
             read_only_if_exists: bool = False) -> NamedTensors:
        """Create one variable per factory in the main graph, in sorted key order.

        Args:
            prefix: prefixes the variables' names (``"<prefix>.<key>"``).
            empty: placeholder values instead of the factories' data.
            memmap_dir: keep each variable's host value in a memory-mapped file
                ``<memmap_dir>/<name>.npy`` (``VariableFactory.next_memmap``): a file that
                exists gives the initial value, and the session writes weights back to it.
            read_only_if_exists: open existing files read-only (they are never written).

        Raises:
            GraphContextError: outside the main graph.
        """
        _check_main("init")
        created = {}
        for name, factory in sorted(self.to_dict().items()):
            created[name] = factory.create_tensor(f"{prefix}.{name}" if prefix else name, empty, memmap_dir,
                                                  read_only_if_exists)
        return NamedTensors.from_dict(created)

    def init_remote(self, buffers: "NamedRemoteBuffers", entry: int = 0, prefix: str | None = None,
                    empty: bool = False, memmap_dir: str | None = None,
                    read_only_if_exists: bool = False) -> NamedTensors:
        """Create one remote variable per factory, in sorted key order, in entry ``entry``
        of the buffer with the same name in ``buffers`` (see ``popxl_addons.remote``);
        ``memmap_dir`` and ``read_only_if_exists`` as in ``init`` (initial values only).

        Raises:
            GraphContextError: outside the main graph.
            InvalidArgumentError: a factory has no buffer of its name.
        """
        _check_main("init_remote")
        by_name = buffers.to_dict()
        missing = sorted(set(self.to_dict()) - set(by_name))
        if missing:
            raise InvalidArgumentError(
                f"init_remote: no remote buffer for the factories {missing} (buffers: {sorted(by_name)})",
                where=context.user_source_line(),
                fix="make the buffers from these factories, e.g. named_variable_buffers(facts)")
        created = {}
        for name, factory in sorted(self.to_dict().items()):
            created[name] = factory.create_remote_tensor(by_name[name], entry, f"{prefix}.{name}" if prefix else name,
                                                         empty, memmap_dir, read_only_if_exists)
        return NamedTensors.from_dict(created)

    def init_zero(self) -> NamedTensors:
        """A zero tensor (``ops.init``) per factory in the current graph (any graph)."""
        return NamedTensors.from_dict({name: _init_op(f.shape, f.dtype, name, "zero")
                                       for name, f in self.to_dict().items()})

    def init_undef(self) -> NamedTensors:
        """An uninitialised tensor (``ops.init``) per factory in the current graph (any graph)."""
        return NamedTensors.from_dict({name: _init_op(f.shape, f.dtype, name, "undef")
                                       for name, f in self.to_dict().items()})

    @property
    def replica_groupings(self) -> Any:
        """A ``NamedReplicaGrouping`` of the factories' replica groupings, by name."""
        from ipuxl.addons_compat.named_replica_grouping import NamedReplicaGrouping

        return NamedReplicaGrouping.from_dict({name: f.replica_grouping for name, f in self.to_dict().items()})


def _check_main(method: str) -> None:
    graph = context.gcg()
    if not graph.is_main:
        raise GraphContextError(
            f"NamedVariableFactories.{method}() called while building subgraph '{graph.name}': variables "
            "can only be created in the main graph", where=context.user_source_line(),
            fix=f"call facts.{method}() under `with ir.main_graph:` and bind or pass the variables to the graph")


def add_variable_input(name: str, data_iter: Callable[[], Any] | Iterable[Any], dtype: DTypeLike = None,
                       by_ref: bool = False, replica_grouping: Any = None) -> tuple[Tensor, VariableFactory]:
    """A graph input of the current graph and the factory for its variables."""
    factory = VariableFactory(data_iter, dtype, name, by_ref, replica_grouping)
    return factory.create_input(), factory


def add_replica_sharded_variable_input(name: str, data_iter: Callable[[], Any] | Iterable[Any],
                                       dtype: DTypeLike = None, by_ref: bool = False,
                                       replica_grouping: ReplicaGrouping | None = None,
                                       shard_over: int | None = None) -> tuple[Tensor, VariableFactory]:
    """A replica-sharded graph input of the current graph and the factory for its variables.

    The input is the 1-D shard (meta shape: the data's shape); ``shard_over`` defaults
    to the size of ``replica_grouping`` (default: all replicas), as upstream.
    """
    group = replica_grouping or context.gcg().ir.replica_grouping()
    factory = VariableFactory(data_iter, dtype, name, by_ref, group, shard_over or group.group_size)
    return factory.create_input(), factory
