"""Host transfers: ``host_load`` reads a host-to-device stream, ``host_store`` writes one.

In the compiled main program each loaded stream is an argument and each stored
stream is an output slot the op copies into, so a transfer happens exactly where it
is in program order (a later in-place update cannot change what was stored).
"""
from __future__ import annotations

from typing import Any

import torch

from ipuxl.ir.build import check_same_graph, emit
from ipuxl.dtypes import dtype_name
from ipuxl.errors import GraphContextError, InvalidArgumentError, ShapeMismatchError
from ipuxl.ir import context
from ipuxl.ir.graph import Graph, describe
from ipuxl.ir.meta import OP, OP_ID, ROLE, STREAM, Role
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream, Stream
from ipuxl.ir.tensor import Tensor

__all__ = ["host_load", "host_store"]


def _main_graph_only(op_name: str, stream: Any, kind: type[Stream]) -> Graph:
    """The current graph, checked to be the main graph of ``stream``'s IR."""
    graph = context.gcg()
    if not isinstance(stream, kind):
        raise InvalidArgumentError(
            f"{op_name} needs a {kind.__name__} as its first argument, got {describe(stream)}",
            where=context.user_source_line(),
            fix=f"call {op_name}(stream, ...) with a stream made by ipuxl."
                f"{'h2d_stream' if kind is HostToDeviceStream else 'd2h_stream'}(shape, dtype, name)")
    if not graph.is_main:
        raise GraphContextError(
            f"{op_name} of stream '{stream.name}' in subgraph '{graph.name}': host transfers are "
            "supported in the main graph only", where=context.user_source_line(),
            fix="load/store in the main graph and pass the tensor to the subgraph call; use "
                "ir.num_host_transfers for device iterations")
    if stream.ir is not graph.ir:
        raise GraphContextError(
            f"{op_name}: stream '{stream.name}' belongs to another Ir than graph '{graph.name}'",
            where=context.user_source_line(), fix="create the stream under `with ir.main_graph:` of this Ir")
    return graph


def _streams_in(graph: Graph, role: str) -> list[Stream]:
    """The streams whose slots (``role``: ``Role.H2D`` or ``Role.D2H``) ``graph`` has."""
    return [n.meta[STREAM] for n in graph.fx.nodes if n.meta.get(ROLE) == role]


def host_load(h2d_stream: HostToDeviceStream, name: str | None = None) -> Tensor:
    """Read the next value of ``h2d_stream`` into the program."""
    graph = _main_graph_only("host_load", h2d_stream, HostToDeviceStream)
    if h2d_stream in _streams_in(graph, Role.H2D):
        raise GraphContextError(f"stream '{h2d_stream.name}' is loaded twice in one program",
                                where=context.user_source_line(),
                                fix="load it once and reuse the tensor")
    tensor = graph.add_input(h2d_stream.spec, name or h2d_stream.name, role=Role.H2D)
    tensor.node.meta[STREAM] = h2d_stream
    tensor.node.meta[OP] = "host_load"
    tensor.node.meta[OP_ID] = graph.ir.next_op_id()
    return tensor


def host_store(d2h_stream: DeviceToHostStream, t: Tensor) -> None:
    """Send ``t`` to the host through ``d2h_stream``."""
    graph = _main_graph_only("host_store", d2h_stream, DeviceToHostStream)
    if not isinstance(t, Tensor):
        raise InvalidArgumentError(
            f"host_store of stream '{d2h_stream.name}' needs a Tensor to store, got {describe(t)}",
            where=context.user_source_line(), fix="pass a tensor of the main graph: ops.host_store(stream, t)")
    check_same_graph(graph, "host_store", (t,), {})  # before the slot is added: no half-built store
    if t.spec != d2h_stream.spec:
        raise ShapeMismatchError(
            f"host_store: stream '{d2h_stream.name}' carries {d2h_stream.shape} "
            f"{dtype_name(d2h_stream.dtype)}, got tensor {describe(t)}",
            where=context.user_source_line(),
            fix="create the stream with the tensor's spec: ipuxl.d2h_stream(t.shape, t.dtype)")
    if d2h_stream in _streams_in(graph, Role.D2H):
        raise GraphContextError(f"stream '{d2h_stream.name}' is stored twice in one program",
                                where=context.user_source_line(), fix="use one d2h stream per stored tensor")
    slot = graph.add_input(d2h_stream.spec, f"{d2h_stream.name}_slot", role=Role.D2H)
    slot.node.meta[STREAM] = d2h_stream
    emit("host_store", torch.Tensor.copy_, (slot, t), modifies=slot, name=f"store_{d2h_stream.name}")
