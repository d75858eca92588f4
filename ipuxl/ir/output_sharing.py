"""Which call outputs lowering may return as aliases of the call's inputs.

A PopXL call returns new tensors, so lowering (``ir.lower``) copies an output whose
storage is one of the call's inputs: a subgraph that transposes a weight, or reshapes an
activation it saves for the backward pass, would otherwise hand its caller a view of that
input. So too an output whose storage another output shares (``return y, y.T``). The copy
is needed only where a caller could tell: where the storage is written while the output
is still read, or the output is written. ``OutputSharing`` decides, per call site, which
outputs may stay aliases:

* an output's *roots* are the storage owners it may share: the call's inputs, and the
  call's other outputs, that the callee's output may share (``summary``, per graph,
  through its own calls), and theirs when such an input is itself an earlier call's
  output (``may_share``);
* the output and its views are only read (none written, none indexed), and no root is
  written between the call and their last read;
* an output (or a view of it) that the caller returns is read until the end. Roots made
  in the caller that nothing else it returns shares are new storage to the caller's
  callers (returned twice, it is two outputs sharing storage: see below). Otherwise
  (roots that are the caller's inputs, or that other returned outputs share) the
  caller's callers see what the returned output shares (``summary``), and the alias is
  safe only where that output is safe at every call site of the caller (checked the
  same way, up the call chain). A constant or variable of the caller (``get_attr``) is
  never returned as an alias.

Which outputs lowering copies unless allowed (``copy_candidates``): those whose storage
is an input, a constant or a variable, and those that share storage with another output.

A graph compiled once for many call sites (the device's ``Compiler``) returns an output
as an alias only when it is safe at all of them (``everywhere``); a repeat's outputs feed
its next iteration, so a repeated graph's outputs are always copied.

Variables are read through ``get_attr`` nodes; two nodes of the same attribute are one
storage here. Views that lowering copies (``views_to_copy``) own their storage.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Iterable, Mapping, NamedTuple, Sequence, cast

import torch.fx as fx

from ipuxl.ir.aliases import is_view, storage_owner, writes
from ipuxl.ir.calls import call_nodes, callee_of, is_call, is_repeat

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["OutputSharing", "Site", "call_sites", "views_to_copy", "write_positions"]

Site = tuple["Graph", fx.Node]
"""A call site: the calling graph and its call node."""


def call_sites(graphs: Iterable["Graph"]) -> dict["Graph", list[Site]]:
    """Every call and repeat node of ``graphs``, by the graph it calls."""
    sites: dict["Graph", list[Site]] = {}
    for caller in graphs:
        for node in call_nodes(caller):
            sites.setdefault(callee_of(node), []).append((caller, node))
    return sites


def write_positions(graph: "Graph") -> dict[fx.Node, list[int]]:
    """Program positions of the in-place writes to each written storage root."""
    positions: dict[fx.Node, list[int]] = {}
    for i, node in enumerate(graph.fx.nodes):
        for written in writes(node):
            positions.setdefault(written, []).append(i)
    return positions


def views_to_copy(graph: "Graph") -> set[fx.Node]:
    """View nodes that must become copies to keep PopXL's value semantics.

    torch's reshape, slicing, transpose... return views where PopXL ops return new
    tensors. A view must be copied when an in-place op writes through it, or when
    its source is written after the view is made and before its last use.
    """
    order = {node: i for i, node in enumerate(graph.fx.nodes)}
    positions = write_positions(graph)
    copied: set[fx.Node] = set()
    for node in graph.fx.nodes:
        if not is_view(node):
            continue
        root = storage_owner(node, copied=copied)
        last_use = max((order[user] for user in node.users), default=-1)
        if node in positions or any(order[node] < w <= last_use for w in positions.get(root, ())):
            copied.add(node)
    return copied


class _Facts:
    """One graph's facts the decisions read (computed once per graph)."""

    def __init__(self, graph: "Graph"):
        self.order = {node: i for i, node in enumerate(graph.fx.nodes)}
        self.copied = views_to_copy(graph)
        self.attrs: dict[str, fx.Node] = {}  # a variable's first get_attr node stands for all of them
        for node in graph.fx.nodes:
            if node.op == "get_attr":
                self.attrs.setdefault(str(node.target), node)
        self.writes: dict[fx.Node, list[int]] = {}
        for written, positions in write_positions(graph).items():
            self.writes.setdefault(self.owner(written), []).extend(positions)
        self.inputs = {t.node: k for k, t in enumerate(graph.inputs)}
        self.returned = [t.node for t in graph.outputs]

    def owner(self, node: fx.Node) -> fx.Node:
        owner = storage_owner(node, copied=self.copied)
        return self.attrs[str(owner.target)] if owner.op == "get_attr" else owner


class OutputSharing:
    """Decides which call outputs may stay aliases (see the module docstring).

    Args:
        sites: every call site of the program's graphs (``call_sites``); without it, an
            output that its caller returns is an alias only when its storage was made in
            that caller and nothing else returned shares it (the caller's own call sites
            are unknown).
    """

    def __init__(self, sites: Mapping["Graph", Sequence[Site]] | None = None):
        self.sites = sites
        self._facts: dict["Graph", _Facts] = {}
        self._summaries: dict["Graph", list[_Shares]] = {}
        self._decided: dict[fx.Node, frozenset[int]] = {}

    def facts(self, graph: "Graph") -> _Facts:
        if graph not in self._facts:
            self._facts[graph] = _Facts(graph)
        return self._facts[graph]

    def copy_candidates(self, graph: "Graph") -> frozenset[int]:
        """The outputs of ``graph`` that lowering copies unless the call site allows the
        alias: those whose storage is an input, a constant or a variable, or that another
        output may share (``y`` and ``y.T``: PopXL returns two new tensors)."""
        facts = self.facts(graph)
        return frozenset(i for i, (node, shares) in enumerate(zip(facts.returned, self.summary(graph)))
                         if facts.owner(node).op in ("placeholder", "get_attr") or shares.outputs)

    def everywhere(self, called: "Graph") -> frozenset[int]:
        """The ``copy_candidates`` of ``called`` that may stay aliases at every call site
        (never a constant's or variable's): those its compiled code returns without a copy."""
        facts = self.facts(called)
        candidates = {i for i in self.copy_candidates(called) if facts.owner(facts.returned[i]).op != "get_attr"}
        return frozenset(candidates) if candidates and self._safe_at_every_site(called, candidates) else frozenset()

    def at_site(self, graph: "Graph", call: fx.Node) -> frozenset[int]:
        """The outputs of ``call`` (a call node of ``graph``) that may stay aliases there."""
        if call not in self._decided:
            self._decided[call] = frozenset() if is_repeat(call) else self._decide(graph, call)
        return self._decided[call]

    def summary(self, graph: "Graph") -> list[_Shares]:
        """For each output of ``graph``: the positions of its inputs, and of its other
        outputs, whose storage it may share."""
        if graph not in self._summaries:
            facts = self.facts(graph)
            owners = [self.may_share(graph, [node]) for node in facts.returned]
            self._summaries[graph] = [
                _Shares(frozenset(facts.inputs[o] for o in mine if o in facts.inputs),
                        frozenset(k for k, theirs in enumerate(owners) if k != i and mine & theirs))
                for i, mine in enumerate(owners)]
        return self._summaries[graph]

    def may_share(self, graph: "Graph", nodes: Iterable[fx.Node]) -> set[fx.Node]:
        """The storage owners in ``graph`` that ``nodes``' values may share: each one's own
        and, for a call's output, those of the call's inputs and other outputs it may
        share (``summary``), transitively."""
        facts = self.facts(graph)
        found: set[fx.Node] = set()
        todo = list(nodes)
        while todo:
            owner = facts.owner(todo.pop())
            if owner in found:
                continue
            found.add(owner)
            if owner.target is operator.getitem and is_call(owner.args[0]):
                todo.extend(self._shared_with(cast(fx.Node, owner.args[0]), cast(int, owner.args[1])))
        return found

    def _shared_with(self, call: fx.Node, index: int) -> list[fx.Node]:
        """The arguments and other outputs (their ``getitem`` nodes) of ``call`` whose
        storage its output ``index`` may share (every argument of a repeat)."""
        args = [a for a in call.args if isinstance(a, fx.Node)]
        if is_repeat(call):
            return args
        shares = self.summary(callee_of(call))[index]
        return ([a for k, a in enumerate(call.args) if k in shares.inputs and isinstance(a, fx.Node)]
                + [u for u in call.users if u.target is operator.getitem and u.args[1] in shares.outputs])

    def _safe_at_every_site(self, graph: "Graph", outputs: Iterable[int]) -> bool:
        sites = self.sites.get(graph, ()) if self.sites is not None else ()
        return bool(sites) and all(set(outputs) <= self.at_site(caller, node) for caller, node in sites)

    def _decide(self, graph: "Graph", call: fx.Node) -> frozenset[int]:
        if any(user.target is not operator.getitem for user in call.users):
            return frozenset()  # the call's tuple itself is used: not followed
        facts = self.facts(graph)
        start = facts.order[call]
        safe = set(range(len(callee_of(call).outputs)))  # an output nobody reads is safe
        for user in call.users:
            index = cast(int, user.args[1])
            aliases = _read_aliases(user, facts.copied)
            if aliases is None or any(facts.owner(a) in facts.writes for a in aliases):
                safe.discard(index)
                continue
            roots = self.may_share(graph, self._shared_with(call, index))
            last_read = max(facts.order[u] for a in aliases for u in [a, *a.users])
            escaping = [k for k, node in enumerate(facts.returned) if node in aliases]
            if escaping:
                if not self._may_escape(graph, escaping, aliases, roots):
                    safe.discard(index)
                    continue
                last_read = len(facts.order)
            if any(start < w <= last_read for r in roots for w in facts.writes.get(r, ())):
                safe.discard(index)
        return frozenset(safe)

    def _may_escape(self, graph: "Graph", escaping: list[int], aliases: set[fx.Node], roots: set[fx.Node]) -> bool:
        """Whether ``graph`` may return an alias of ``roots`` (at its outputs ``escaping``)."""
        facts = self.facts(graph)
        if any(r.op == "get_attr" for r in roots):
            return False
        others = [node for node in facts.returned if node not in aliases]
        if not any(r in facts.inputs for r in roots) and not self.may_share(graph, others) & roots:
            return True  # new storage, to the callers (several outputs of it: ``copy_candidates``)
        # the callers see what it shares (``summary``): their writes to that count at their sites
        return self._safe_at_every_site(graph, escaping)


class _Shares(NamedTuple):
    """What one output of a graph may share storage with: inputs and other outputs, by position."""

    inputs: frozenset[int]
    outputs: frozenset[int]


def _read_aliases(node: fx.Node, copied: set[fx.Node]) -> set[fx.Node] | None:
    """``node`` and its views, transitively (a view lowering copies is a read of its source,
    not followed); None when one of them is indexed (``getitem``: not followed)."""
    found = {node}
    todo = [node]
    while todo:
        for user in todo.pop().users:
            if user.target is operator.getitem:
                return None
            if is_view(user) and user not in copied and user not in found:
                found.add(user)
                todo.append(user)
    return found
