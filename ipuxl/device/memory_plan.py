"""The device's memory plan: large results written into buffers kept between steps.

A compiled graph runs with the same shapes every step, so its large intermediate
results can live in buffers made once (``kernels.workspace``) rather than in fresh
allocations, whose pages the CPU faults in and zeroes on every step. ``plan_memory``
picks the results, gives results whose lifetimes do not overlap the same buffer, and
rewrites their ops into their ``out=`` forms writing into that buffer.

A result is planned when:

* its op is an aten op with one tensor result, mutating nothing, whose ``out=`` form
  has a kernel of its own for the device (not a copy after the functional op), or a
  dense ``embedding_dense_backward`` (``kernels.embedding.embedding_grad_into``);
* it has at least ``min_bytes`` (``MIN_BYTES``: 32 MiB, the size from which glibc hands out
  fresh pages however the session tunes it), fixed sizes, and dense strides;
* it does not outlive the graph's run: neither it nor any view of it is an output of
  the graph, and every reader is known to read it (an aten op, an in-place
  ``torch.Tensor`` method or ``ipuxl.kernels`` update such as a copy to a host stream or
  an optimiser step, an embedding gradient sum); a reader ipuxl cannot see into (a call
  of another compiled graph, any other Python function) keeps it out of the plan.

Its lifetime runs from its op to the last reader of it or of any view of it. Each
planned graph gets one arena (``kernels.workspace``); results get byte offsets in it,
largest first, each at the lowest offset clear of the results alive at the same time
(``_pack``): results never alive together share bytes, whatever their shapes and dtypes.
Lifetimes include both ends, so a result never shares bytes with its own op's inputs.

Only CPU programs are planned: torch's CUDA caching allocator already reuses memory.

Numerics: unchanged (the same kernels, writing elsewhere).
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx

from ipuxl.device.host_memory import MMAP_THRESHOLD
from ipuxl.device.rewrites._nodes import embedding_grad_args
from ipuxl.kernels.embedding import add_embedding_grad, embedding_grad_into
from ipuxl.kernels.losses import log_softmax_nll_grad
from ipuxl.kernels.conv import convolution_backward
from ipuxl.kernels.pool import max_pool2d_with_indices
from ipuxl.kernels.workspace import Workspace, buffer

__all__ = ["MIN_BYTES", "plan_memory", "out_overload"]

MIN_BYTES = MMAP_THRESHOLD
"""Smaller results are left to the allocator: the session keeps freed blocks below glibc's
mmap threshold in the heap (``device.host_memory``), so they come back without page faults.
Planning them too measured slower: torchvision CNNs at 1 MiB took 1.1-1.6x as long a step."""

_aten = torch.ops.aten
WORKSPACE_ATTR = "ipuxl_workspace"
_EMBEDDING_GRAD = _aten.embedding_dense_backward.default
_UNANNOTATED_VIEWS = frozenset({_aten._unsafe_view.default})
"""Aten ops whose result is a view of an argument although their schema does not say so."""
_READERS = frozenset({torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.clone, convolution_backward,
                      max_pool2d_with_indices})
"""Python functions that only read their tensor arguments and return new tensors."""
_RETURN_FIRST = frozenset({add_embedding_grad, embedding_grad_into, log_softmax_nll_grad})
"""Kernels that may return their first argument and only read the others."""


def plan_memory(graph: fx.Graph, root: torch.nn.Module, workspace: Workspace, device: torch.device,
                min_bytes: int | None = None) -> int:
    """Plan ``graph``'s large results (``min_bytes`` or more; default ``MIN_BYTES``) into
    ``workspace``'s buffers (``root``: the module the graph's code will run on; it gets the
    workspace as an attribute). Returns how many results were planned."""
    if device.type != "cpu":
        return 0
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    order = {node: i for i, node in enumerate(graph.nodes)}
    last = _lifetimes(graph, order, device, min_bytes)
    if not last:
        return 0
    first = {node: order[node] for node in last}
    offsets, size = _pack(first, last)
    arena = workspace.new_arena(size)
    setattr(root, WORKSPACE_ATTR, workspace)
    with graph.inserting_before(next(iter(graph.nodes))):
        ws = graph.get_attr(WORKSPACE_ATTR)
    for node, offset in offsets.items():
        _write_into_buffer(graph, node, ws, arena, offset, node.meta["val"], device)
    return len(last)


def _nbytes(node: fx.Node) -> int:
    """The bytes of a planned result (dense: contiguous or channels-last, ``_plannable``)."""
    meta = node.meta["val"]
    return meta.numel() * meta.element_size()


def _pack(first: dict[fx.Node, int], last: dict[fx.Node, int]) -> tuple[dict[fx.Node, int], int]:
    """Byte offsets for the results (lifetime ``first[n]`` to ``last[n]``, inclusive: a result
    never shares bytes with a result read by its own op) and the arena's size.

    Largest first, each at the lowest aligned offset clear of the results already placed
    whose lifetimes overlap its own (first fit): results that are never alive together
    share bytes whatever their shapes."""
    align = Workspace.ALIGN
    placed: list[tuple[int, int, int, int]] = []  # (first, last, offset, end)
    offsets: dict[fx.Node, int] = {}
    for node in sorted(first, key=lambda n: (-_nbytes(n), first[n])):
        size = -(-_nbytes(node) // align) * align
        busy = sorted((o, e) for f, l, o, e in placed if f <= last[node] and first[node] <= l)
        offset = 0
        for start, end in busy:
            if offset + size <= start:
                break
            offset = max(offset, end)
        offsets[node] = offset
        placed.append((first[node], last[node], offset, offset + size))
    return offsets, max((e for *_, e in placed), default=0)


def _write_into_buffer(graph: fx.Graph, node: fx.Node, ws: fx.Node, arena: int, offset: int, meta: torch.Tensor,
                       device: torch.device) -> None:
    with graph.inserting_before(node):
        buf = graph.call_function(buffer, (ws, arena, offset, list(meta.shape), list(meta.stride()), meta.dtype,
                                           device))
    buf.meta["val"] = meta
    if node.target is _EMBEDDING_GRAD:
        grad, indices, _, padding_idx, _ = embedding_grad_args(node)
        node.target, node.args, node.kwargs = embedding_grad_into, (buf, grad, indices, padding_idx), {}
        return
    assert isinstance(node.target, torch._ops.OpOverload)
    out = out_overload(node.target)
    assert out is not None
    name = next(a.name for a in out._schema.arguments if a.is_out)
    node.target, node.kwargs = out, {**node.kwargs, name: buf}


def _lifetimes(graph: fx.Graph, order: dict[fx.Node, int], device: torch.device,
               min_bytes: int) -> dict[fx.Node, int]:
    """The plannable results and the position (``order``) of the last node reading each (or a view of it)."""
    owner: dict[fx.Node, fx.Node] = {}  # a planned result's views -> the result
    last: dict[fx.Node, int] = {}
    escaped: set[fx.Node] = set()
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            result = owner.get(arg)
            if result is None or result in escaped:
                continue
            use = _use(node, arg)
            if use == "escape":
                escaped.add(result)
                continue
            last[result] = max(last[result], order[node])
            if use == "alias":
                owner[node] = result
        if _plannable(node, device, min_bytes):
            owner[node] = node
            last[node] = order[node]
    return {node: i for node, i in last.items() if node not in escaped}


def _plannable(node: fx.Node, device: torch.device, min_bytes: int) -> bool:
    if node.op != "call_function":
        return False
    meta = node.meta.get("val")
    if not (isinstance(meta, torch.Tensor) and meta.layout == torch.strided
            and all(isinstance(s, int) for s in (*meta.shape, *meta.stride()))
            and meta.numel() * meta.element_size() >= min_bytes
            and (meta.is_contiguous() or meta.is_contiguous(memory_format=torch.channels_last))):
        return False
    if node.target is _EMBEDDING_GRAD:
        *_, padding_idx, scale = embedding_grad_args(node)
        return scale is False and isinstance(padding_idx, int)
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if schema.is_mutable or len(schema.returns) != 1 or schema.returns[0].alias_info is not None:
        return False
    if str(schema.returns[0].type) != "Tensor":
        return False
    out = out_overload(target)
    key = "CPU" if device.type == "cpu" else device.type.upper()
    return out is not None and torch._C._dispatch_has_kernel_for_dispatch_key(out.name(), key)


@functools.lru_cache(maxsize=None)
def out_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``op``'s ``out=`` form: the overload with the same arguments and one out argument."""
    packet = op.overloadpacket
    args = [(a.name, str(a.type)) for a in op._schema.arguments]
    for name in packet.overloads():
        candidate = getattr(packet, name)
        schema = candidate._schema
        outs = [a for a in schema.arguments if a.is_out]
        if len(outs) == 1 and len(schema.returns) == 1 and [
                (a.name, str(a.type)) for a in schema.arguments if not a.is_out] == args:
            return candidate
    return None


def _use(node: fx.Node, arg: fx.Node) -> str:
    """How ``node`` uses ``arg`` (a planned result or a view of one): "read" (only reads
    it), "alias" (its result may be ``arg``'s memory) or "escape" (it may keep it)."""
    if node.op != "call_function":
        return "escape"  # the graph's output
    target = node.target
    if target is operator.getitem:
        return "alias"
    if target in _UNANNOTATED_VIEWS:
        return "alias"
    if isinstance(target, torch._ops.OpOverload):
        positions = [a for a, value in _schema_args(node) if _mentions(value, arg)]
        return "alias" if any(a.alias_info is not None for a in positions) else "read"
    if target in _RETURN_FIRST or _updates_first(target):
        return "alias" if node.args and _mentions(node.args[0], arg) else "read"
    return "read" if target in _READERS else "escape"


def _updates_first(target: Any) -> bool:
    """An in-place ``torch.Tensor`` method or ``ipuxl.kernels`` update (a name ending in ``_``):
    it writes (and returns) its first argument and reads the others."""
    name = getattr(target, "__name__", "")
    if not name.endswith("_"):
        return False
    return getattr(torch.Tensor, name, None) is target or getattr(target, "__module__", "").startswith("ipuxl.kernels.")


def _schema_args(node: fx.Node) -> Iterator[tuple[Any, Any]]:
    arguments = node.target._schema.arguments  # type: ignore[union-attr]
    for i, value in enumerate(node.args):
        if i < len(arguments):
            yield arguments[i], value
    by_name = {a.name: a for a in arguments}
    for name, value in node.kwargs.items():
        if name in by_name:
            yield by_name[name], value


def _mentions(value: Any, arg: fx.Node) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_mentions(v, arg) for v in value)
    return value is arg

