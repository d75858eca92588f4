"""Calls of subgraphs in the IR: the node types and the walks over called graphs.

A call of graph ``g`` is an fx ``call_function`` node whose target is
``CallTarget(g)`` (``ops.call``) or ``RepeatTarget(g, n)`` (``ops.repeat``); its
tuple of outputs is read through ``operator.getitem`` nodes. Ask these questions
through the functions here (``callee``, ``is_repeat``, ``called_graphs``,
``reachable_graphs``...), never by importing the lowering module.

Host transfers (``host_transfers``, ``does_host_io``, ``transfer_counts``) are asked
here too: how often each stream's load or store runs per run of a graph is static,
since call and repeat counts are, except in the branches of a conditional (``IO_GATE``
calls), of which only one transfers: counts then have a most and a fewest.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch.fx as fx

from ipuxl.ir.graph import identifier
from ipuxl.ir.meta import IO_GATE, ROLE, STREAM, Role

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir
    from ipuxl.ir.streams import Stream

__all__ = [
    "CallTarget", "RepeatTarget", "run_repeat", "callee", "callee_of", "is_call", "is_repeat", "repeat_count",
    "call_nodes", "called_graphs", "reachable_graphs", "reachable_from", "any_reachable", "CALL_COST", "MIN_SAVINGS",
    "is_host_transfer", "does_host_io", "transfer_counts",
]

#: A call site's cost in ops (the resource model charges a call a few control instructions).
CALL_COST = 0.1

#: Op instances a repeated region must save over all its copies to be outlined into one
#: called graph (by the outlining pass, and by module capture for repeated blocks): two
#: copies of a small layer stay inline (the device can then fuse across them); N blocks
#: of a deep model do not.
MIN_SAVINGS = 8.0


class CallTarget:
    """Target of an fx node that calls a subgraph (``ops.call``).

    Calling it directly lowers the callee on the fly (slow; for debugging with
    ``fx.Interpreter``). The device replaces it by the callee's compiled code.
    """

    def __init__(self, graph: "Graph"):
        self.graph = graph
        self.__name__ = identifier(f"call_{graph.name}")

    def __call__(self, *args: Any) -> tuple:
        from ipuxl.ir.lower import graph_callable  # lowering builds on this module

        return graph_callable(self.graph)(*args)


class RepeatTarget(CallTarget):
    """Target of an fx node that runs a subgraph ``count`` times (``ops.repeat``)."""

    def __init__(self, graph: "Graph", count: int):
        super().__init__(graph)
        self.count = count
        self.__name__ = identifier(f"repeat_{graph.name}")

    def __call__(self, *args: Any) -> tuple:
        from ipuxl.ir.lower import graph_callable

        return run_repeat(graph_callable(self.graph), self.count, len(self.graph.outputs), args)


def run_repeat(body: Callable[..., tuple], count: int, n_carried: int, args: tuple, io: Any = None) -> tuple:
    """PopXL's loop: outputs ``i < n_carried`` feed inputs ``i`` of the next iteration.

    ``io``: the run's host-transfer cursors, passed first to a body that does host IO.
    """
    values = list(args)
    if count == 0:
        return tuple(v.clone() for v in values[:n_carried])
    if n_carried == 0:  # nothing carried (a device loop updating variables in place)
        if io is None:
            for _ in range(count):
                body(*values)
        else:
            for _ in range(count):
                body(io, *values)
        return ()
    for _ in range(count):
        values[:n_carried] = body(*values) if io is None else body(io, *values)
    return tuple(values[:n_carried])


# -- questions about one node -----------------------------------------------------------
def callee(node: Any) -> "Graph | None":
    """The graph ``node`` calls (``ops.call`` or ``ops.repeat``), else ``None``."""
    target = getattr(node, "target", None)
    return target.graph if isinstance(target, CallTarget) and node.op == "call_function" else None


def callee_of(node: fx.Node) -> "Graph":
    """The graph the call or repeat ``node`` runs; ``node`` must be one (see ``is_call``)."""
    graph = callee(node)
    if graph is None:
        raise TypeError(f"node '{node.name}' is not a call of a subgraph")
    return graph


def is_call(node: Any) -> bool:
    """True for a call or repeat of a subgraph."""
    return callee(node) is not None


def is_repeat(node: Any) -> bool:
    """True for an ``ops.repeat`` node."""
    return isinstance(getattr(node, "target", None), RepeatTarget)


def repeat_count(node: fx.Node) -> int:
    """How many times ``node`` runs its callee: the loop count of a repeat, 1 for a call."""
    target = node.target
    return target.count if isinstance(target, RepeatTarget) else 1


# -- walks over called graphs --------------------------------------------------------------
def call_nodes(graph: "Graph") -> Iterator[fx.Node]:
    """The call and repeat nodes of ``graph``, in program order."""
    return (n for n in graph.fx.nodes if is_call(n))


def called_graphs(graph: "Graph") -> list["Graph"]:
    """The graphs ``graph`` calls directly, each once, in order of first call."""
    found: dict["Graph", None] = {}
    for node in call_nodes(graph):
        found.setdefault(callee_of(node))
    return list(found)


def reachable_from(roots: Iterable["Graph"]) -> list["Graph"]:
    """``roots`` and every graph they call, directly or not; each once, depth first."""
    seen: dict["Graph", None] = {}
    todo = list(roots)[::-1]
    while todo:
        graph = todo.pop()
        if graph in seen:
            continue
        seen[graph] = None
        todo.extend(reversed(called_graphs(graph)))
    return list(seen)


def reachable_graphs(ir: "Ir") -> list["Graph"]:
    """The main graph and every graph it calls, directly or not (the ones the device
    compiles), in the IR's order of creation."""
    seen = set(reachable_from([ir.main_graph]))
    return [g for g in ir.graphs if g in seen]


def any_reachable(graph: "Graph", predicate: Callable[[fx.Node], bool]) -> bool:
    """True when ``predicate`` holds for a node of ``graph`` or of a graph it calls."""
    return any(predicate(n) for g in reachable_from([graph]) for n in g.fx.nodes)


# -- host transfers ----------------------------------------------------------------------
def is_host_transfer(node: fx.Node) -> bool:
    """True for a host load op or a host store's slot (one per ``ops.host_store``)."""
    return node.meta.get(ROLE) in Role.STREAMS and STREAM in node.meta


def does_host_io(graph: "Graph") -> bool:
    """True when ``graph`` or a graph it calls loads or stores a host stream."""
    return any_reachable(graph, is_host_transfer)


def transfer_counts(graph: "Graph", fewest: bool = False) -> "Counter[Stream]":
    """How many times each stream is loaded or stored in one run of ``graph``: its own
    transfers plus each callee's times its call sites' counts (a repeat runs its body
    ``count`` times). Of a conditional's two branches (``IO_GATE`` calls on one condition)
    only one runs: the branch with the most transfers of a stream counts, or with
    ``fewest`` the branch with the fewest (a stream may then take fewer slices in a run)."""
    memo: dict["Graph", Counter[Stream]] = {}
    pick = min if fewest else max

    def counts(g: "Graph") -> "Counter[Stream]":
        if g not in memo:
            total: Counter[Stream] = Counter()
            branches: dict[tuple[Any, bool], Counter[Stream]] = {}
            for node in g.fx.nodes:
                if is_host_transfer(node):
                    total[node.meta[STREAM]] += 1
                elif is_call(node):
                    into = branches.setdefault(node.meta[IO_GATE], Counter()) if IO_GATE in node.meta else total
                    for stream, k in counts(callee_of(node)).items():
                        into[stream] += k * repeat_count(node)
            for (index, taken_when), taken in branches.items():
                if taken_when:
                    other = branches.get((index, False), Counter())
                    for stream in set(taken) | set(other):
                        total[stream] += pick(taken[stream], other[stream])
            memo[g] = total
        return memo[g]

    return counts(graph)
