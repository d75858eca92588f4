"""Schedule: a liveness-aware order of a graph's ops, and applying it.

Every graph runs in program order (the order its ops were built) unless a user or
the resource model reorders it with this pass::

    order = memory_schedule(graph)
    apply_schedule(graph, order)   # lowering now runs ``order``

or, both at once with the pass contract (``passes.result.PassResult``)::

    result = reorder_for_memory(graph)   # result.modified: the order changed

Preconditions: none beyond a well-formed graph; side effects are kept by
``passes.inplace_order.side_effect_constraints`` (reads and writes of written
storage, ``in_sequence`` ops, collectives and host stores keep their program order).

Algorithm (:func:`memory_schedule`):

1. dependencies: data edges plus the side-effect constraints;
2. list scheduling: among ready ops pick the one that adds the fewest live bytes
   (bytes it allocates minus storages it is the last reader of), looking ahead along
   single-consumer chains, so an op whose chain soon frees a large input wins
   (``lookahead``); ties go to program order, so the result is deterministic;
3. score the candidates (program order and the greedy variants) with
   ``liveness.live_profile`` and return the lowest peak; program order wins ties,
   so the result is never worse than program order.

Limits: the greedy choice is a heuristic (minimising peak memory is NP-hard); the
estimate is ``live_profile``'s (allocator fragmentation and the device's own
scheduling are not modelled). A called graph's own order is not changed: schedule
it separately.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch.fx as fx

from ipuxl.errors import PassError
from ipuxl.ir.aliases import storage_owner
from ipuxl.passes.inplace_order import side_effect_constraints
from ipuxl.passes.liveness import live_profile, node_bytes
from ipuxl.passes.result import PassResult

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["reorder_for_memory", "memory_schedule", "list_schedule", "apply_schedule", "schedule_dependencies",
           "program_order"]

_LEAVES = ("placeholder", "get_attr", "output")


def program_order(graph: "Graph") -> list[fx.Node]:
    """The graph's ops (no placeholders, get_attr or output) in program order."""
    return [n for n in graph.fx.nodes if n.op not in _LEAVES]


def schedule_dependencies(graph: "Graph") -> dict[fx.Node, set[fx.Node]]:
    """For each op, the ops that must run before it: data inputs plus side-effect constraints."""
    ops = program_order(graph)
    members = set(ops)
    constraints = side_effect_constraints(graph)
    deps: dict[fx.Node, set[fx.Node]] = {}
    for node in ops:
        before = {a for a in node.all_input_nodes if a in members}
        before.update(p for p in constraints.get(node, ()) if p in members)
        deps[node] = before
    return deps


def memory_schedule(graph: "Graph", lookahead: int = 4) -> list[fx.Node]:
    """A topological order of ``graph``'s ops that keeps live activation bytes low.

    Respects data edges and ``side_effect_constraints``; its peak
    (``live_profile(graph, order).peak_bytes``) is never above program order's.

    Args:
        graph: the graph to schedule (not modified: see :func:`apply_schedule`).
        lookahead: how many single-consumer successors to look through when scoring.

    Returns:
        The ops (no placeholders, get_attr or output) in the new order.
    """
    ops = program_order(graph)
    if len(ops) < 2:
        return ops
    deps = schedule_dependencies(graph)
    candidates = [ops] + [_greedy(graph, ops, deps, depth) for depth in sorted({0, lookahead})]
    best, best_peak = ops, live_profile(graph, ops).peak_bytes
    for order in candidates[1:]:
        peak = live_profile(graph, order).peak_bytes
        if peak < best_peak:
            best, best_peak = order, peak
    return list(best)


def list_schedule(graph: "Graph", lookahead: int = 4) -> list[fx.Node]:
    """The greedy list schedule itself (step 2), without the fall-back to program order.

    Always a valid order (data edges and side-effect constraints kept), but its peak
    may be above program order's: use :func:`memory_schedule` to reduce memory.
    """
    ops = program_order(graph)
    return _greedy(graph, ops, schedule_dependencies(graph), lookahead) if ops else ops


class _Liveness:
    """Bookkeeping of the greedy scheduler: storages, their sizes and unscheduled readers."""

    def __init__(self, graph: "Graph", ops: list[fx.Node]):
        self.size = {n: node_bytes(n) for n in ops}
        self.outputs = {storage_owner(t.node) for t in graph.outputs}
        self.roots: dict[fx.Node, set[fx.Node]] = {}  # op -> allocating storages it reads
        self.readers: dict[fx.Node, int] = {}  # storage -> number of unscheduled readers
        for node in ops:
            roots = {storage_owner(a) for a in node.all_input_nodes}
            roots = {r for r in roots if self.size.get(r) and r not in self.outputs}
            self.roots[node] = roots
            for r in roots:
                self.readers[r] = self.readers.get(r, 0) + 1

    def delta(self, node: fx.Node, pending: dict[fx.Node, int] | None = None) -> int:
        """Live bytes after ``node`` minus before (``pending``: readers already counted off)."""
        pending = pending or {}
        kept = self.size[node] if (self.readers.get(node) or node in self.outputs) else 0
        freed = sum(self.size[r] for r in self.roots[node] if self.readers[r] - pending.get(r, 0) == 1)
        return kept - freed

    def schedule(self, node: fx.Node) -> None:
        for r in self.roots[node]:
            self.readers[r] -= 1


def _greedy(graph: "Graph", ops: list[fx.Node], deps: dict[fx.Node, set[fx.Node]],
            lookahead: int) -> list[fx.Node]:
    """List scheduling by live-byte delta (with chain lookahead), ties by program order."""
    position = {n: i for i, n in enumerate(ops)}
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in ops}
    waiting = {n: len(d) for n, d in deps.items()}
    for node, before in deps.items():
        for p in before:
            users[p].append(node)
    live = _Liveness(graph, ops)
    ready = [n for n in ops if waiting[n] == 0]
    order: list[fx.Node] = []
    while ready:
        best = min(ready, key=lambda n: (_score(live, n, users, waiting, lookahead), position[n]))
        ready.remove(best)
        order.append(best)
        live.schedule(best)
        for user in users[best]:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.append(user)
    if len(order) != len(ops):  # a cycle cannot happen with program-order constraints
        raise PassError(f"memory_schedule: graph '{graph.name}' has a dependency cycle",
                        fix="report this: side-effect constraints follow program order")
    return order


def _score(live: _Liveness, node: fx.Node, users: dict[fx.Node, list[fx.Node]],
           waiting: dict[fx.Node, int], lookahead: int) -> tuple[int, int]:
    """(best cumulative live-byte delta along ``node``'s chain, delta of ``node`` itself).

    The chain follows the only op that waits on nothing else once its predecessor
    has run, up to ``lookahead`` ops, so ``a = big(x); b = sum(a)`` scores as the pair
    (+small) instead of ``a`` alone (+big).
    """
    first = live.delta(node)
    best, total = first, first
    pending: dict[fx.Node, int] = {r: 1 for r in live.roots[node]}
    current = node
    for _ in range(lookahead):
        nxt = [u for u in users[current] if waiting[u] == 1]
        if len(users[current]) != 1 or len(nxt) != 1:
            break
        current = nxt[0]
        total += live.delta(current, pending)
        for r in live.roots[current]:
            pending[r] = pending.get(r, 0) + 1
        best = min(best, total)
    return best, first


def reorder_for_memory(graph: "Graph", lookahead: int = 4) -> PassResult:
    """The schedule pass: reorder ``graph``'s ops in place to ``memory_schedule(graph)``.

    Returns:
        ``PassResult(graph, modified)``: modified when the order changed.
    """
    return PassResult(graph, apply_schedule(graph, memory_schedule(graph, lookahead)))


def apply_schedule(graph: "Graph", order: Sequence[fx.Node]) -> bool:
    """Reorder ``graph``'s fx nodes to ``order``, so lowering runs the ops in that order.

    Placeholders and ``get_attr`` nodes stay first (in their order), the output node
    (if any) last.

    Args:
        graph: the graph to reorder in place.
        order: every op of the graph once (as returned by :func:`memory_schedule`).

    Returns:
        True when the order changed.

    Raises:
        PassError: ``order`` is not a permutation of the graph's ops, or breaks a data
            edge or a side-effect constraint.
    """
    ops = program_order(graph)
    order = list(order)
    if len(order) != len(ops) or set(order) != set(ops):
        raise PassError(f"apply_schedule: the order for graph '{graph.name}' does not list each of its "
                        f"{len(ops)} ops exactly once (got {len(order)} entries)",
                        fix="pass the list returned by memory_schedule(graph) for this graph")
    _check_order(graph, order)
    if order == ops:
        return False
    head = [n for n in graph.fx.nodes if n.op in ("placeholder", "get_attr")]
    anchor = head[-1] if head else None
    for node in order:
        if anchor is None:
            first = next(iter(graph.fx.nodes))
            if first is not node:
                first.prepend(node)
        else:
            anchor.append(node)
        anchor = node
    graph.fx.lint()
    return True


def _check_order(graph: "Graph", order: list[fx.Node]) -> None:
    position = {n: i for i, n in enumerate(order)}
    for node, before in schedule_dependencies(graph).items():
        for p in before:
            if position[p] > position[node]:
                kind = "data input" if p in node.all_input_nodes else "side-effect constraint"
                raise PassError(
                    f"apply_schedule: in graph '{graph.name}' op '{node.name}' would run before '{p.name}' "
                    f"({kind})", fix="keep data edges and passes.inplace_order.side_effect_constraints")
