"""popxl.addons' batch serialisation: run a graph ``steps`` times, loading each step's
inputs and storing its outputs, so one phase of phased execution processes a whole
batch while its variables are loaded once.

``batch_serialise(graph, steps, load_handles, store_streams, store_buffers)`` returns a
graph that takes one int32 input (the row) and repeats ``graph`` ``steps`` times; each
step ``i``:

1. loads each input in ``load_handles`` from its host stream or from a remote buffer
   ``(buffer, row_offset)`` at entry ``(row + row_offset) * steps + i``;
2. calls ``graph`` with them and with the other inputs, which become inputs of the new
   graph (passed through, by reference when they were);
3. stores the tensors in ``store_streams`` / ``store_buffers`` the same way.

A remote buffer is a matrix: ``steps`` columns (the batch index) and rows (one per
layer sharing the graph, ``rows``); a ``row_offset`` of None always reads row 0. A buffer
handle is ``(buffer, row_offset)`` or popxl.addons' ``RemoteHandle(buffer, row_offset,
shard_group)``; as upstream, pairs are converted to ``RemoteHandle``s, so the result's
``stored_buffers`` always holds ``RemoteHandle``s (``.buffer``, ``.row_offset``,
``.shard_group``). With a ``shard_group`` of more than one replica the buffer holds
replica-sharded activations (``batch_serial_buffer(..., shard_group=g)``): each member
stores its shard of the tensor (``replica_sharded_slice``) and a load gathers the
shards back (``replicated_all_gather``), so every member of the group holds the whole
tensor while Streaming Memory holds it once per group.
``batch_serialise_fwd_and_grad`` also stores the forward activations the gradient
graph needs in new buffers and loads them in the gradient graph's loop; a
``store_buffers`` value that is a ``ReplicaGrouping`` (upstream's form) asks for that
activation's new buffer to be sharded over the grouping.

Reproduces the API of the PopXL phased-execution tutorial (``batch_serial_buffer(t,
steps, rows)``). Where it differs: ``io_mode`` "io" and "io_overlapped" run as
"compute" (the simulated device has no IO tiles; values are the same).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal, Mapping, NamedTuple, Sequence, TypeGuard, Union

from ipuxl.addons_compat.bound_args import SubsetBindGraph
from ipuxl.addons_compat.graph import GraphWithNamedArgs
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.dtypes import int32, uint32
from ipuxl.errors import InvalidArgumentError, InvalidValueError, with_builtin
from ipuxl.ir import context
from ipuxl.ir.context import in_sequence
from ipuxl.ir.grad_info import ExpectedConnectionType
from ipuxl.ir.graph import Graph
from ipuxl.ir.graph_builder import graph_input, graph_output
from ipuxl.ir.meta import BY_REF
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream
from ipuxl.ir.tensor import Tensor
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ops.call import call_with_info, repeat
from ipuxl.ops.collectives import replica_sharded_slice, replicated_all_gather
from ipuxl.ops.host import host_load, host_store
from ipuxl.ops.random import split_random_seed
from ipuxl.ops.remote import remote_load, remote_store

__all__ = ["batch_serialise", "batch_serialise_fwd_and_grad", "batch_serial_buffer", "BatchSerialResult",
           "RemoteHandle"]


class RemoteHandle(NamedTuple):
    """Where a batch-serialised tensor lives in Streaming Memory: ``buffer``, the row offset
    (None: always row 0) and the replicas its shards are spread over (None or a group of
    one: not sharded)."""

    buffer: Any
    row_offset: int | None = 0
    shard_group: ReplicaGrouping | None = None


RemoteBufferAndOffset = Union[RemoteHandle, tuple[Any, Union[int, None]]]
LoadHandle = Union[HostToDeviceStream, RemoteBufferAndOffset]
IoMode = Literal["compute", "io", "io_overlapped"]


@dataclass
class BatchSerialResult:
    """The result of a batch serialisation.

    Attributes:
        graph: the new graph (input: the row; named args: the passed-through inputs).
        stored_buffers: original-graph tensor -> the ``RemoteHandle`` (buffer, row offset,
            shard group) it was stored in.
    """

    graph: GraphWithNamedArgs
    stored_buffers: dict[Tensor, RemoteHandle]
    _remap_dict: dict[Tensor, Tensor]

    def remap_tensors(self, ts: NamedTensors) -> NamedTensors:
        """``ts`` with original-graph inputs replaced by the new graph's inputs."""
        return ts.remap(self._remap_dict)


def batch_serial_buffer(t: Tensor, steps: int = 1, rows: int = 1, shard_group: ReplicaGrouping | None = None) -> Any:
    """A remote buffer for ``t``'s spec with ``steps * rows`` entries (one per batch
    step and row; batch serialisation grows it when it needs more). With a
    ``shard_group`` of more than one replica, a replica-sharded buffer: each entry holds
    one shard of ``t`` per member (``meta_shape`` is ``t``'s shape)."""
    from ipuxl.ir.remote import remote_buffer, replica_sharded_buffer

    if shard_group is not None and shard_group.group_size > 1:
        host_shape = (shard_group.num_groups, *t.shape) if shard_group.num_groups > 1 else t.shape  # PopXL's layout
        return replica_sharded_buffer(host_shape, t.dtype, replica_grouping=shard_group, entries=steps * rows)
    return remote_buffer(t.shape, t.dtype, steps * rows)


def _is_buffer_handle(handle: Any) -> TypeGuard[RemoteBufferAndOffset]:
    return isinstance(handle, tuple) and len(handle) in (2, 3) and hasattr(handle[0], "tensor_shape") and (
        handle[1] is None or isinstance(handle[1], int))


def _as_remote_handles(handles: Mapping[Tensor, Any]) -> dict[Tensor, Any]:
    """``handles`` with each ``(buffer, row_offset[, shard_group])`` tuple made a ``RemoteHandle``
    (upstream's ``_convert_to_remote_handles``; a new dict: the caller's is left as it was).
    Streams, ``RemoteHandle``s and handles of no known kind (refused when used) are kept."""
    return {t: RemoteHandle(*h) if _is_buffer_handle(h) and not isinstance(h, RemoteHandle) else h
            for t, h in handles.items()}


def _shard_group(handle: RemoteBufferAndOffset) -> ReplicaGrouping | None:
    """The group a handle's tensor is sharded over, or None when its buffer holds whole tensors."""
    group = handle[2] if len(handle) == 3 else None
    return group if group is not None and group.group_size > 1 and handle[0].meta_shape else None


def _entry(index: Tensor, handle: RemoteBufferAndOffset, steps: int, rows: int) -> Tensor:
    """The entry of ``handle``'s buffer for loop index ``index`` (row * steps + step),
    growing the buffer to hold every entry the graph can reach."""
    buffer, row_offset = handle[0], handle[1]
    if row_offset is None:
        entry, size = index % steps, steps
    elif row_offset:
        entry, size = index + row_offset * steps, steps * (row_offset + rows)
    else:
        entry, size = index, steps * rows
    buffer.entries = max(buffer.entries, size)
    return entry


def _load(t: Tensor, handle: LoadHandle, index: Tensor, steps: int, rows: int) -> Tensor:
    if isinstance(handle, HostToDeviceStream):
        return host_load(handle, t.name)
    if _is_buffer_handle(handle):
        loaded = remote_load(handle[0], _entry(index, handle, steps, rows), t.name)
        group = _shard_group(handle)
        return replicated_all_gather(loaded, group=group).reshape(t.shape) if group is not None else loaded
    raise InvalidArgumentError(f"batch_serialise: load handle of '{t.name}' must be a HostToDeviceStream or a "
                               f"(RemoteBuffer, row_offset) pair or a RemoteHandle, got {handle!r}",
                               where=context.user_source_line(),
                               fix="pass popxl.h2d_stream(...), (buffer, 0) or RemoteHandle(buffer, 0, shard_group)")


def batch_serialise(graph: GraphWithNamedArgs, steps: int, load_handles: Mapping[Tensor, LoadHandle],
                    store_streams: Mapping[Tensor, DeviceToHostStream],
                    store_buffers: Mapping[Tensor, RemoteBufferAndOffset], seed_input: Tensor | None = None,
                    rows: int = 1, io_mode: IoMode = "io") -> BatchSerialResult:
    """Transform ``graph`` to repeat its computation ``steps`` times (module docstring).

    Inputs not in ``load_handles`` (nor ``seed_input``) become the new graph's inputs
    after the row; outputs not stored are dropped. With ``seed_input`` the new graph
    takes a seed and each step gets its own (``split_random_seed``).

    Raises:
        InvalidValueError: ``rows`` < 1, ``steps`` < 1 or an unknown ``io_mode``.
        InvalidArgumentError: a load handle that is neither a stream nor a buffer pair.
    """
    if io_mode not in ("compute", "io", "io_overlapped"):
        raise InvalidValueError(f"Unknown 'io_mode' {io_mode!r}", where=context.user_source_line(),
                                fix="use 'compute', 'io' or 'io_overlapped'")
    if rows < 1 or steps < 1:
        raise InvalidValueError(f"batch_serialise: steps and rows must be >= 1, got steps={steps}, rows={rows}",
                                where=context.user_source_line(), fix="serialise over at least one step and row")
    if io_mode != "compute":
        logging.getLogger(__name__).debug("batch_serialise: io_mode %r runs as 'compute' (no IO tiles)", io_mode)
    load_handles, store_buffers = _as_remote_handles(load_handles), _as_remote_handles(store_buffers)
    source = graph.graph
    loaded_ts = [t for t in source.inputs if t in load_handles]
    stored_ts = [t for t in chain(source.inputs, source.outputs)
                 if (t in store_streams or t in store_buffers)
                 and not (t in load_handles and not isinstance(load_handles[t], HostToDeviceStream))]
    through_ts = [t for t in source.inputs if t is not seed_input and t not in load_handles]

    ir = source.ir
    outer = ir.create_empty_graph(f"{source.base_name}_repeat_graph")
    with outer, in_sequence(True):
        row = graph_input([], int32, "batch_serial_loop_index")
        seed = graph_input((2,), uint32, "batch_serial_random_seed") if seed_input is not None else None
        through = [_input_like(t) for t in through_ts]
        body = _micro_graph(graph, steps, rows, loaded_ts, stored_ts, through_ts, seed_input,
                            load_handles, store_streams, store_buffers)
        carried = [row * steps] + ([seed] if seed is not None else [])
        repeat(body, steps, *carried, *through)

    remap = dict(zip(through_ts, through))
    stored_buffers: dict[Tensor, RemoteHandle] = {}
    for t in (t for t in store_buffers if t in source):
        handle = load_handles.get(t)
        stored_buffers[t] = handle if isinstance(handle, RemoteHandle) else store_buffers[t]
    return BatchSerialResult(SubsetBindGraph(outer, graph.args.remap(remap)), stored_buffers, remap)


def _input_like(t: Tensor) -> Tensor:
    return graph_input(t.shape, t.dtype, t.name, by_ref=bool(t.node.meta.get(BY_REF)), meta_shape=t.meta_shape)


def _micro_graph(graph: GraphWithNamedArgs, steps: int, rows: int, loaded_ts: Sequence[Tensor],
                 stored_ts: Sequence[Tensor], through_ts: Sequence[Tensor], seed_input: Tensor | None,
                 load_handles: Mapping[Tensor, LoadHandle], store_streams: Mapping[Tensor, DeviceToHostStream],
                 store_buffers: Mapping[Tensor, RemoteBufferAndOffset]) -> Graph:
    """The loop body: inputs (index, [seed], *passed through), outputs (index + 1, [next seed])."""
    body = graph.graph.ir.create_empty_graph(f"{graph.graph.base_name}_batch_serial_step")
    with body, in_sequence(True):
        index = graph_input([], int32, "batch_serial_index")
        seed = graph_input((2,), uint32, "batch_serial_seed") if seed_input is not None else None
        through = [_input_like(t) for t in through_ts]
        # 1. load this step's inputs
        inputs = {t: _load(t, load_handles[t], index, steps, rows) for t in loaded_ts}
        inputs.update(zip(through_ts, through))
        next_seed = None
        if seed is not None and seed_input is not None:
            step_seed, next_seed = split_random_seed(seed)
            inputs[seed_input] = step_seed
        # 2. compute
        info = call_with_info(graph.graph, inputs_dict=inputs)
        # 3. store
        for t in stored_ts:
            value = inputs[t] if t in inputs else info.graph_to_parent(t)
            if t in store_streams:
                host_store(store_streams[t], value)
            if t in store_buffers:
                handle = store_buffers[t]
                group = _shard_group(handle)
                if group is not None:  # this member's shard of the (identical) tensor
                    value = replica_sharded_slice(value, group=group)
                remote_store(handle[0], _entry(index, handle, steps, rows), value)
        graph_output(index + 1)
        if next_seed is not None:
            graph_output(next_seed)
    return body


def batch_serialise_fwd_and_grad(forward_graph: GraphWithNamedArgs, gradient_graph: GraphWithNamedArgs,
                                 named_inputs_for_grad_graph: NamedTensors, steps: int,
                                 load_handles: Mapping[Tensor, LoadHandle],
                                 store_streams: Mapping[Tensor, DeviceToHostStream],
                                 store_buffers: Mapping[Tensor, RemoteBufferAndOffset | ReplicaGrouping],
                                 seed_input: Tensor | None = None, rows: int = 1,
                                 io_mode: IoMode = "io") -> tuple[BatchSerialResult, BatchSerialResult]:
    """Batch-serialise a forward graph and its gradient graph (module docstring).

    Forward activations the gradient graph reads are stored by the forward loop (in
    new buffers, or the buffer the forward input was loaded from) and loaded by the
    gradient loop; those in ``named_inputs_for_grad_graph`` (usually the forward
    variables, ``fwd.args``) become named inputs of the gradient graph instead, as
    upstream. Every gradient input needs a load handle. A ``store_buffers`` value that is a
    ``ReplicaGrouping`` shards that activation's new buffer over the grouping.

    Raises:
        InvalidArgumentError: (also a ValueError, as upstream) a gradient input without a
            load handle; an activation that can be neither stored nor named.
    """
    info = gradient_graph.grad_graph_info
    grad_inputs = gradient_graph.graph.inputs
    shard_groups = {t: g for t, g in store_buffers.items() if isinstance(g, ReplicaGrouping)}
    buffers: dict[Tensor, RemoteBufferAndOffset] = {
        t: h for t, h in store_buffers.items() if not isinstance(h, ReplicaGrouping)}
    named = named_inputs_for_grad_graph.named_tensors
    activations = [(i, c) for i, c in enumerate(info.expected_inputs) if c.connection_type is ExpectedConnectionType.Fwd]
    # 1. the forward loop stores every activation the gradient graph needs
    for _, connection in activations:
        t = connection.fwd_tensor
        if t in buffers or t in named.values():
            continue
        handle = load_handles.get(t)
        if _is_buffer_handle(handle):
            buffers[t] = handle
        else:
            group = shard_groups.get(t)
            buffers[t] = RemoteHandle(batch_serial_buffer(t, steps, rows, shard_group=group), 0, group)
    forward_result = batch_serialise(forward_graph, steps, load_handles, store_streams, buffers, seed_input,
                                     rows, io_mode)
    # 2. the gradient loop loads them (or takes them as named inputs)
    grad_handles: dict[Tensor, LoadHandle] = {}
    named_inputs: dict[str, Tensor] = {}
    for index, connection in activations:
        t = connection.fwd_tensor
        name = next((n for n, v in named.items() if v is t), None)
        if name is not None:
            named_inputs[name] = grad_inputs[index]
        elif t in forward_result.stored_buffers:
            grad_handles[grad_inputs[index]] = forward_result.stored_buffers[t]
        else:  # unreachable: step 1 stored every activation that is not named
            raise InvalidArgumentError(f"batch_serialise_fwd_and_grad: activation '{t.name}' is neither stored nor "
                                       "a named input", where=context.user_source_line(),
                                       fix="add it to named_inputs_for_grad_graph or to load_handles")
    named_inputs.update(gradient_graph.args.named_tensors)
    gradient_graph.args = NamedTensors.from_dict(named_inputs)
    for index, connection in enumerate(info.expected_inputs):
        if connection.connection_type is ExpectedConnectionType.FwdGrad:
            grad_t = grad_inputs[index]
            if grad_t not in load_handles:
                raise with_builtin(InvalidArgumentError, ValueError)(
                    f"batch_serialise_fwd_and_grad: gradient input {index} ('{grad_t.name}') of graph "
                    f"'{gradient_graph.graph.name}' has no load handle", where=context.user_source_line(),
                    fix="give load_handles an entry for each gradient input, e.g. {grad.graph.inputs[0]: (buffer, 0)}")
            grad_handles[grad_t] = load_handles[grad_t]
    gradient_result = batch_serialise(gradient_graph, steps, grad_handles, store_streams, buffers, None, rows,
                                      io_mode)
    gradient_result.graph.grad_graph_info = info
    return forward_result, gradient_result
