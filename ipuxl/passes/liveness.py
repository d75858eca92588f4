"""Liveness: how many bytes of activations a graph holds at each step of a schedule.

A *storage* is the memory one op allocates. Views (``reshape``, slices...) and in-place
results do not allocate: they alias the storage they come from and keep it alive
(``ipuxl.ir.aliases.storage_owner``). Each output of a multi-output op (a call's
outputs, ``max_pool``'s values and indices) is its own storage, owned by its tuple
item, so one output can be freed while another is still read. A storage is live from
the op that allocates it to the last op that reads it or any alias of it; a graph
output lives to the end. Variables and
constants are always live and counted apart (``always_live_bytes``). Inputs of a
subgraph belong to the caller; the main graph's host loads are host-stream buffers.

A call to a subgraph adds, while it runs, the callee's own peak (computed from the
callee's program order, once per graph).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.fx as fx

from ipuxl.ir.aliases import storage_owner
from ipuxl.ir.calls import callee
from ipuxl.ir.meta import ROLE, STREAM, Role

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["LiveProfile", "live_profile", "node_bytes", "always_live_bytes", "stream_bytes", "tensor_bytes"]


@dataclass
class LiveProfile:
    """Live activation bytes per scheduled op (``live[i]`` while ``order[i]`` runs)."""

    order: list[fx.Node]
    live: list[int] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max(self.live, default=0)

    @property
    def peak_at(self) -> fx.Node | None:
        return self.order[self.live.index(self.peak_bytes)] if self.live else None


def tensor_bytes(value: Any) -> int:
    """Bytes of a meta value: a tensor, or a tuple/list of them."""
    if isinstance(value, torch.Tensor):
        return math.prod(value.shape) * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def _is_tuple(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _allocates(node: fx.Node) -> bool:
    if node.op in ("get_attr", "output", "placeholder") or _is_tuple(node):
        return False  # leaves belong to others; a tuple's outputs are allocated by its items
    if node.meta.get(ROLE) == Role.H2D:
        return False  # a host load's value is its stream's buffer slot (counted as stream buffers)
    return storage_owner(node) is node


def node_bytes(node: fx.Node) -> int:
    """Bytes the op allocates (0 for views, in-place results, tuples, leaves)."""
    return tensor_bytes(node.meta.get("val")) if _allocates(node) else 0


def always_live_bytes(graph: "Graph") -> int:
    """Variables and constants of ``graph`` (and, for the main graph, of the IR)."""
    total = 0
    for node in graph.fx.nodes:
        if node.op == "get_attr":
            total += tensor_bytes(node.meta.get("val"))
    return total


def stream_bytes(graph: "Graph") -> int:
    """Host-stream buffers of ``graph``'s own transfers: one slot per stream it loads or stores
    (however many times)."""
    slots = {n.meta[STREAM]: n.meta.get("val") for n in graph.fx.nodes
             if n.meta.get(ROLE) in Role.STREAMS and STREAM in n.meta}
    return sum(tensor_bytes(val) for val in slots.values())


def live_profile(graph: "Graph", order: Sequence[fx.Node] | None = None,
                 _callee_peaks: dict["Graph", int] | None = None) -> LiveProfile:
    """Live activation bytes at each op of ``order`` (default: program order)."""
    nodes = [n for n in (order if order is not None else graph.fx.nodes) if n.op not in ("placeholder", "get_attr",
                                                                                          "output")]
    position = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            root = storage_owner(arg)
            last_use[root] = max(last_use.get(root, -1), position[node])
    for t in graph.outputs:
        last_use[storage_owner(t.node)] = end
    callee_peaks = {} if _callee_peaks is None else _callee_peaks
    profile = LiveProfile(list(nodes))
    live = 0
    frees: dict[int, int] = {}
    for i, node in enumerate(nodes):
        size = node_bytes(node)
        live += size
        if size:
            frees[last_use.get(node, i)] = frees.get(last_use.get(node, i), 0) + size
        transient = 0
        called = callee(node)
        if called is not None:
            # while it runs: the callee's peak, its outputs included (its tuple items own them after)
            if called not in callee_peaks:
                callee_peaks[called] = 0  # recursion guard
                callee_peaks[called] = live_profile(called, None, callee_peaks).peak_bytes
            transient = callee_peaks[called]
        profile.live.append(live + transient)
        live -= frees.pop(i, 0)
    return profile
