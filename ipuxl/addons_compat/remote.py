"""popxl.addons' ``remote``: remote buffers for named variables, and graphs that load
and store them.

Streaming Memory (the off-chip memory of each replica) holds ``RemoteBuffer``s: arrays
of ``entries`` tensors of one spec. A model's variables can live there
(``NamedVariableFactories.init_remote``) and be loaded into on-chip memory only for
the phase that uses them. ``named_variable_buffers`` makes one buffer per factory
(replica sharded where asked), ``load_remote_graph`` / ``store_remote_graph`` make
graphs moving one entry of every buffer, ``load_remote`` / ``store_remote`` do it
inline.

Reproduces the popxl.addons API of the PopXL tutorials (``shard_over_dict``). Where it
differs: ``use_io_tiles`` is accepted and has no effect, and ``merge_exchange`` (which
only merges the exchanges on hardware) is not applied.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import ipuxl
from ipuxl.addons_compat.dot_tree import DotTree
from ipuxl.addons_compat.bound_args import SubsetBindGraph
from ipuxl.addons_compat.graph import GraphWithNamedArgs
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.rts import replica_sharded_spec
from ipuxl.addons_compat.variable_factory import NamedVariableFactories
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir import context
from ipuxl.ir.context import in_sequence
from ipuxl.ir.graph_builder import graph_input, graph_output
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Tensor, TensorSpec
from ipuxl.ops.remote import remote_load, remote_store

__all__ = ["NamedRemoteBuffers", "named_buffers", "named_variable_buffers", "create_remote_buffer",
           "load_remote_graph", "load_remote", "store_remote_graph", "store_remote"]


class NamedRemoteBuffers(DotTree["ipuxl.RemoteBuffer"]):
    """A ``DotTree`` of remote buffers, e.g. one per variable of a layer."""


def named_buffers(tensors: NamedTensors, entries: int = 1) -> NamedRemoteBuffers:
    """A buffer with ``entries`` entries per tensor of ``tensors``, matching its spec
    (a sharded tensor's buffer keeps its meta shape)."""
    buffers = {}
    for name, t in tensors.to_dict().items():
        spec = replica_sharded_spec(t, 1)
        buffer = ipuxl.remote_buffer(spec.shape, spec.dtype, entries)
        buffer.meta_shape = spec.meta_shape
        buffers[name] = buffer
    return NamedRemoteBuffers.from_dict(buffers)


def named_variable_buffers(factories: NamedVariableFactories, entries: int = 1,
                           shard_over_dict: Mapping[str, int] | int | bool = True) -> NamedRemoteBuffers:
    """A buffer with ``entries`` entries per factory of ``factories``, by the same names.

    Args:
        factories: the variable factories (e.g. a module's ``create_graph`` result).
        entries: entries per buffer (e.g. one per layer sharing the graph).
        shard_over_dict: how many replicas of each factory's replica group shard its
            variable: a dict by name, one int for all, ``True`` (default: the whole
            group) or ``False`` (no sharding; as ``1``). A factory that is already
            sharded (has a meta shape) gets a buffer of its shard.

    Raises:
        InvalidArgumentError: a bad ``shard_over_dict`` or a count that does not divide
            a factory's elements.
    """
    buffers = {}
    for name, factory in factories.to_dict().items():
        group = factory.replica_grouping or context.gcg().ir.replica_grouping()
        if isinstance(shard_over_dict, Mapping):
            shard_over = shard_over_dict.get(name)
        elif isinstance(shard_over_dict, bool):
            shard_over = group.group_size if shard_over_dict else 1
        elif isinstance(shard_over_dict, int):
            if not 1 <= shard_over_dict <= group.group_size:
                raise InvalidArgumentError(
                    f"named_variable_buffers: shard_over_dict={shard_over_dict} for '{name}' is not in "
                    f"[1, {group.group_size}] (its replica group size)", where=context.user_source_line(),
                    fix="shard over at most the replicas of the variable's replica grouping")
            shard_over = shard_over_dict
        else:
            raise InvalidArgumentError(
                f"named_variable_buffers: shard_over_dict must be a dict, an int or a bool, got "
                f"{type(shard_over_dict).__name__}", where=context.user_source_line(),
                fix="pass {name: replicas}, a replica count, or True/False")
        spec = TensorSpec(tuple(factory.shape), factory.dtype, tuple(factory.meta_shape or ()))
        buffers[name] = create_remote_buffer(spec, entries, group, shard_over)
    return NamedRemoteBuffers.from_dict(buffers)


def create_remote_buffer(spec: TensorSpec, entries: int = 1, replica_group: ReplicaGrouping | None = None,
                         shard_over: int | None = None) -> "ipuxl.RemoteBuffer":
    """A remote buffer for tensors of ``spec``.

    A spec with a meta shape gets a buffer of its shard; otherwise ``shard_over`` > 1
    (default: the size of ``replica_group``, default all replicas) gives a replica-sharded
    buffer (``popxl.replica_sharded_buffer``), 1 a plain one.

    Raises:
        InvalidArgumentError: ``shard_over`` does not divide the spec's element count.
    """
    ir = context.gcg().ir
    replica_group = replica_group or ir.replica_grouping()
    shard_over = shard_over or replica_group.group_size
    if spec.meta_shape:
        buffer = ipuxl.remote_buffer(spec.shape, spec.dtype, entries)
        buffer.meta_shape = spec.meta_shape
        return buffer
    if shard_over > 1:
        nelms = math.prod(spec.shape)
        if nelms % shard_over:
            raise InvalidArgumentError(
                f"create_remote_buffer: can't shard a tensor of {nelms} elements (shape {spec.shape}) over "
                f"{shard_over} replicas", where=context.user_source_line(),
                fix="shard over a replica count that divides the element count, or pass shard_over=1")
        shape = (replica_group.num_groups, *spec.shape) if replica_group.num_groups > 1 else spec.shape
        return ipuxl.replica_sharded_buffer(shape, spec.dtype, replica_group, shard_over, entries)
    return ipuxl.remote_buffer(spec.shape, spec.dtype, entries)


def load_remote_graph(buffers: NamedRemoteBuffers, entries: int = 1,
                      use_io_tiles: bool = False) -> tuple[GraphWithNamedArgs, list[str]]:
    """A graph taking an int32 entry index whose outputs are that entry of each buffer,
    in sorted name order. Each buffer grows to at least ``entries`` entries.

    Usage::

        g, names = load_remote_graph(buffers)
        ts = NamedTensors.pack(names, g.call(0))
    """
    ir = context.gcg().ir
    graph = ir.create_empty_graph("load_remote")
    names = []
    with graph, in_sequence(False):
        index = graph_input([], ipuxl.int32, "load_index")
        for name, buffer in zip(*buffers.unpack()):
            buffer.entries = max(buffer.entries, entries)
            names.append(name)
            graph_output(remote_load(buffer, index, name))
    return SubsetBindGraph(graph), names


def load_remote(buffers: NamedRemoteBuffers, entry: int | Tensor = 0, use_io_tiles: bool = False) -> NamedTensors:
    """Load entry ``entry`` of each buffer into the current graph."""
    with in_sequence(False):
        return NamedTensors.from_dict({name: remote_load(buffer, entry, name)
                                       for name, buffer in buffers.to_dict().items()})


def store_remote_graph(buffers: NamedRemoteBuffers, entries: int = 1,
                       use_io_tiles: bool = False) -> GraphWithNamedArgs:
    """A graph taking an int32 entry index and a named input per buffer, storing each
    input into that entry of its buffer. Each buffer grows to at least ``entries`` entries.

    Usage::

        g = store_remote_graph(buffers)
        g.bind(tensors).call(0)
    """
    ir = context.gcg().ir
    graph = ir.create_empty_graph("store_remote")
    args = {}
    with graph, in_sequence(False):
        index = graph_input([], ipuxl.int32, "store_index")
        for name, buffer in zip(*buffers.unpack()):
            buffer.entries = max(buffer.entries, entries)
            store_t = graph_input(buffer.tensor_shape, buffer.tensor_dtype, name, meta_shape=buffer.meta_shape)
            remote_store(buffer, index, store_t)
            args[name] = store_t
    return SubsetBindGraph(graph, NamedTensors.from_dict(args))


def store_remote(buffers: NamedRemoteBuffers, tensors: NamedTensors, entry: int | Tensor = 0,
                 use_io_tiles: bool = False) -> None:
    """Store each tensor of ``tensors`` into entry ``entry`` of the buffer of the same name."""
    with in_sequence(False):
        for buffer, tensor in buffers.to_mapping(tensors).items():
            remote_store(buffer, entry, tensor)
