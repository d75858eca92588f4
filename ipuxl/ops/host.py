"""Host transfers: ``host_load`` reads a host-to-device stream, ``host_store`` writes one.

As in PopXL, both are ops of any graph of the stream's IR (the main graph, a called
subgraph, the body of ``ops.repeat``), and every *execution* of one takes (or gives)
the next of the stream's ``ir.num_host_transfers`` slices of a ``Session.run``. The
device loop is therefore an ``ops.repeat`` whose body loads its batch; a gradient
accumulation program may load one stream several times in one graph.

A load is one op (target ``kernels.host_io.host_load``) in program order; a store
copies the tensor into a slot placeholder (``Role.D2H``) the device fills with the
stream's next output slice right before the copy, so a transfer happens exactly
where it is in program order (a later in-place update cannot change what was stored).
"""
from __future__ import annotations

from typing import Any

import torch

from ipuxl.ir.build import check_same_graph, emit
from ipuxl.dtypes import dtype_name
from ipuxl.errors import GraphContextError, InvalidArgumentError, ShapeMismatchError
from ipuxl.ir import context
from ipuxl.ir.graph import Graph, describe
from ipuxl.ir.meta import ROLE, STREAM, Role
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream, Stream
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels.host_io import host_load as _load_kernel

__all__ = ["host_load", "host_store"]


def _stream_graph(op_name: str, stream: Any, kind: type[Stream]) -> Graph:
    """The current graph, checked to belong to ``stream``'s IR."""
    graph = context.gcg()
    if not isinstance(stream, kind):
        raise InvalidArgumentError(
            f"{op_name} needs a {kind.__name__} as its first argument, got {describe(stream)}",
            where=context.user_source_line(),
            fix=f"call {op_name}(stream, ...) with a stream made by ipuxl."
                f"{'h2d_stream' if kind is HostToDeviceStream else 'd2h_stream'}(shape, dtype, name)")
    if stream.ir is not graph.ir:
        raise GraphContextError(
            f"{op_name}: stream '{stream.name}' belongs to another Ir than graph '{graph.name}'",
            where=context.user_source_line(), fix="create the stream under a graph of this Ir")
    return graph


def host_load(h2d_stream: HostToDeviceStream, name: str | None = None) -> Tensor:
    """Read the next slice of ``h2d_stream`` (each execution of the op reads one).

    Args:
        h2d_stream: the stream to read.
        name: the loaded tensor's name (default: the stream's).

    Returns:
        A tensor of the stream's shape and dtype.
    """
    _stream_graph("host_load", h2d_stream, HostToDeviceStream)
    spec = h2d_stream.spec
    tensor = emit("host_load", _load_kernel, (h2d_stream.name,), name=name or h2d_stream.name,
                  meta_fn=lambda *_: spec.to_meta())
    tensor.node.meta[STREAM] = h2d_stream
    tensor.node.meta[ROLE] = Role.H2D
    return tensor


def host_store(d2h_stream: DeviceToHostStream, t: Tensor) -> None:
    """Send ``t`` to the host as the next slice of ``d2h_stream`` (each execution sends one)."""
    graph = _stream_graph("host_store", d2h_stream, DeviceToHostStream)
    if not isinstance(t, Tensor):
        raise InvalidArgumentError(
            f"host_store of stream '{d2h_stream.name}' needs a Tensor to store, got {describe(t)}",
            where=context.user_source_line(), fix="pass a tensor of the current graph: ops.host_store(stream, t)")
    check_same_graph(graph, "host_store", (t,), {})  # before the slot is added: no half-built store
    if not t.spec.same_data(d2h_stream.spec):
        raise ShapeMismatchError(
            f"host_store: stream '{d2h_stream.name}' carries {d2h_stream.shape} "
            f"{dtype_name(d2h_stream.dtype)}, got tensor {describe(t)}",
            where=context.user_source_line(),
            fix="create the stream with the tensor's spec: ipuxl.d2h_stream(t.shape, t.dtype)")
    slot = graph.add_input(d2h_stream.spec, f"{d2h_stream.name}_slot", role=Role.D2H)
    slot.node.meta[STREAM] = d2h_stream
    emit("host_store", torch.Tensor.copy_, (slot, t), modifies=slot, name=f"store_{d2h_stream.name}")
