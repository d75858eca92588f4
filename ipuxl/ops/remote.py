"""Streaming Memory ops (PopXL's ``ops.remote_load``, ``remote_load_``, ``remote_store``,
``remote_code_load``).

Loads and stores move one slot of a ``RemoteBuffer`` (``ipuxl.ir.remote``) between the
running replica's Streaming Memory and on-chip memory. They are ops of any graph of the
buffer's IR. Their order is program order: every remote op is recorded as an
``in_sequence`` op, so no pass moves a load past a store (the buffer is not a tensor of
the graph, so there is no data edge to keep them apart). ``offset`` is an int (checked
against ``entries`` now) or an integer scalar tensor (checked when the op runs: an
``IndexError`` naming the op and your line).
"""
from __future__ import annotations

from typing import Any, Literal

import torch

from ipuxl.errors import InvalidArgumentError, InvalidValueError, UnsupportedError, WrongGraphError
from ipuxl.ir import context
from ipuxl.ir.build import emit
from ipuxl.ir.graph import Graph, describe
from ipuxl.ir.meta import IN_SEQUENCE, META_SHAPE, REMOTE
from ipuxl.ir.remote import RemoteBuffer, code_loaded_graphs
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import remote as kernels

__all__ = ["remote_load", "remote_load_", "remote_store", "remote_code_load"]


def _checked(op: str, buffer: Any, offset: Any) -> RemoteBuffer:
    if not isinstance(buffer, RemoteBuffer):
        raise InvalidArgumentError(f"{op} needs a RemoteBuffer, got {describe(buffer)}",
                                   where=context.user_source_line(),
                                   fix="make one with ipuxl.remote_buffer(shape, dtype, entries)")
    if buffer.ir is not context.gcg().ir:
        raise WrongGraphError(f"{op}: {buffer} belongs to another Ir than graph '{context.gcg().name}'",
                              where=context.user_source_line(), fix="create the buffer under a graph of this Ir")
    if isinstance(offset, Tensor):
        if not offset.dtype.is_int or offset.nelms != 1:
            raise InvalidValueError(f"{op}: a tensor offset must be one integer, got {describe(offset)}",
                                    where=context.user_source_line(),
                                    fix="pass an int, or an int32 scalar tensor (e.g. a loop counter)")
    else:
        buffer.check_offset(offset, op)
    return buffer


def _mark(t: Tensor, buffer: RemoteBuffer) -> None:
    """Record the buffer an op accesses, and keep the op in program order (module docstring)."""
    t.node.meta[IN_SEQUENCE] = True
    t.node.meta[REMOTE] = buffer


def remote_load(remote_buffer: RemoteBuffer, offset: int | Tensor, name: str | None = None) -> Tensor:
    """A new tensor holding slot ``offset`` of ``remote_buffer`` (PopXL's ``remote_load``).

    The result has the buffer's shape and dtype, and its ``meta_shape`` when the buffer
    is replica-sharded (so ``replicated_all_gather`` restores the full tensor).

    Raises:
        InvalidValueError: an int offset out of ``[0, entries)``, or a tensor offset that
            is not one integer.

    Example:
        >>> loaded = ops.remote_load(buffer, 0)
    """
    buffer = _checked("remote_load", remote_buffer, offset)
    spec = torch.empty(buffer.tensor_shape, dtype=buffer.torch_dtype, device="meta")
    out: Tensor = emit("remote_load", kernels.remote_load, (buffer.remote_buffer_id, offset),
                       meta_fn=lambda *_: torch.empty_like(spec), name=name or f"remote_load_{buffer.remote_buffer_id}")
    if buffer.meta_shape:
        out.node.meta[META_SHAPE] = buffer.meta_shape
    _mark(out, buffer)
    return out


def remote_load_(t: Tensor, remote_buffer: RemoteBuffer, offset: int | Tensor) -> Tensor:
    """Load slot ``offset`` of ``remote_buffer`` into ``t`` in place; returns ``t`` (PopXL's).

    Raises:
        ShapeMismatchError: ``t`` does not match the buffer's shape and dtype.
    """
    buffer = _checked("remote_load_", remote_buffer, offset)
    _check_tensor("remote_load_", t)
    buffer.validate_tensor_matches_buffer(t)
    out: Tensor = emit("remote_load_", kernels.remote_load_, (t, buffer.remote_buffer_id, offset), modifies=t,
                       meta_fn=lambda x, *_: x, name=t.name)
    _mark(out, buffer)
    return out


def remote_store(remote_buffer: RemoteBuffer, offset: int | Tensor, t: Tensor) -> None:
    """Store ``t`` in slot ``offset`` of ``remote_buffer`` (PopXL's ``remote_store``).

    Raises:
        ShapeMismatchError: ``t`` does not match the buffer's shape and dtype.
    """
    buffer = _checked("remote_store", remote_buffer, offset)
    _check_tensor("remote_store", t)
    buffer.validate_tensor_matches_buffer(t)
    out = emit("remote_store", kernels.remote_store, (buffer.remote_buffer_id, offset, t),
               meta_fn=lambda *_: None, name=f"remote_store_{buffer.remote_buffer_id}")
    _mark(out, buffer)


#: PopXL's code locations; only "executable" is implemented there (and here).
CODE_LOCATIONS = ("executable", "compute_buffer", "io_buffer")


def remote_code_load(graph: Graph, destination: Literal["executable", "compute_buffer", "io_buffer"]) -> None:
    """Load ``graph``'s code from Streaming Memory (PopXL's ``remote_code_load``).

    From then on ``graph``'s code lives in Streaming Memory and counts on-chip only while
    loaded (``ipuxl.device.resources``): the code-loaded graphs share one on-chip region,
    the size of the largest. Values are unaffected: the simulated device always has the code.

    Calling a graph before its code is loaded is not an error, as in PopXL (whose docs make
    the order the user's responsibility): the call runs and gives the same values. The
    resource model counts the code of every graph that has a ``remote_code_load`` anywhere
    in the IR as code-loaded (sharing the region) however the calls and loads are ordered;
    a graph never code-loaded is always on-chip, PopXL's rule for graphs never loaded.

    Raises:
        InvalidArgumentError: ``graph`` is not a subgraph of this Ir.
        InvalidValueError: (a ValueError, as PopXL) ``graph`` is the graph being built.
        UnsupportedError: (a NotImplementedError, as PopXL) ``destination`` is not
            ``"executable"`` (PopXL implements only that one).
    """
    current = context.gcg()
    if graph is current:
        raise InvalidValueError(f"The {remote_code_load.__name__} op cannot load the code of the graph it is in "
                                f"('{graph.name}')", where=context.user_source_line(),
                                fix="load the graph's code in its caller, before the call")
    if not isinstance(graph, Graph) or graph.ir is not current.ir or graph.is_main:
        raise InvalidArgumentError(f"remote_code_load needs a subgraph of this Ir, got {describe(graph)}",
                                   where=context.user_source_line(), fix="pass a graph made with ir.create_graph(...)")
    if destination != "executable":
        what = "is not supported (PopXL implements only 'executable')" if destination in CODE_LOCATIONS \
            else f"is not a code location (one of {', '.join(CODE_LOCATIONS)})"
        raise UnsupportedError(f"remote_code_load of graph '{graph.name}': destination {destination!r} {what}",
                               where=context.user_source_line(), fix="use destination='executable'")
    code_loaded_graphs(current.ir)[graph] = destination
    out = emit("remote_code_load", kernels.remote_code_load, (graph.name, destination), meta_fn=lambda *_: None,
               name=f"code_load_{graph.base_name}")
    out.node.meta[IN_SEQUENCE] = True
    out.node.meta[REMOTE] = graph


def _check_tensor(op: str, t: Any) -> None:
    if not isinstance(t, Tensor):
        raise InvalidArgumentError(f"{op} needs a Tensor, got {describe(t)}", where=context.user_source_line(),
                                   fix="pass a tensor of the current graph")
