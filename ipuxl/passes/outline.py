"""Outline: replace structurally identical regions by calls to one shared graph.

On the device a graph called from several sites is compiled once (its code exists
once); a region copied N times costs N copies of code. This pass finds what users
would otherwise outline by hand:

- ``outline_graph(graph)``: repeated *consecutive* regions inside one graph, such
  as the N identical blocks of a model traced from an ``nn.Module`` (forward) and
  their gradients (backward). Every op gets a local signature (what it computes,
  input and output shapes and dtypes, constant arguments); runs of a repeating
  signature sequence are candidates (period p, k copies, found with numpy in
  O(p_max x ops)); a candidate is accepted when every copy also has the same
  internal wiring (which op feeds which, which inputs come from outside, which are
  written in place). The copies become k calls of one new graph, in place of the
  ops, so program order and numerics are unchanged.
- ``deduplicate(graphs)``: several graphs that are structurally identical (e.g. one
  graph created per block) become one; every call site calls the first. Graphs that
  differ raise ``OutlineError`` saying where.
- ``outline_ir(ir)``: ``outline_graph`` over every graph of an IR.

``outline(graph_or_ir)`` and ``merge_identical_graphs(graphs)`` are the same passes
with the pass contract (``passes.result.PassResult``: the graph, and whether it
changed); ``outline_graph``/``outline_ir``/``deduplicate`` say what was made.

Inputs a region writes in place (an optimiser update of a weight) are passed by
reference, so the write still reaches the caller's tensor.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence, cast

import numpy as np
import torch
import torch.fx as fx

from ipuxl.dtypes import dtype_name
from ipuxl.errors import OutlineError
from ipuxl.ir.aliases import storage_owner, writes
from ipuxl.ir.calls import (CALL_COST, MIN_SAVINGS, CallTarget, RepeatTarget, call_nodes, callee, is_call, is_repeat,
                            repeat_count)
from ipuxl.ir.copy import copy_node, remap_records
from ipuxl.ir.graph import Graph
from ipuxl.ir.meta import (BY_REF, BY_REF_ARGS, CALLED_GRAPH, IN_SEQUENCE, MODIFIES, NAME, OP, OP_ID, OUTLINED,
                           ROLE, SOURCE, VIEW_OF, WRITES, Role)
from ipuxl.ir.tensor import TensorSpec
from ipuxl.passes.result import PassResult

if TYPE_CHECKING:
    from ipuxl.ir.ir import Ir

__all__ = ["outline", "merge_identical_graphs", "outline_graph", "outline_ir", "deduplicate", "OutlineSummary"]

_NEVER = ("host_store", "host_load")
_REFS = (MODIFIES, VIEW_OF)  # alias records naming one node


@dataclass
class OutlineSummary:
    """What ``outline_ir`` did: new shared graphs, call sites made, ops removed."""

    graphs: list[Graph] = field(default_factory=list)
    call_sites: int = 0
    ops_before: int = 0
    ops_after: int = 0

    def __str__(self) -> str:
        names = ", ".join(g.name for g in self.graphs) or "none"
        return (f"outlined {len(self.graphs)} graph(s) ({names}) at {self.call_sites} call sites: "
                f"{self.ops_before} -> {self.ops_after} op instances")


# -- signatures ---------------------------------------------------------------------------
def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype))
    if isinstance(value, (tuple, list)):
        return tuple(_spec(v) for v in value)
    return None


def _target_key(node: fx.Node) -> Any:
    target = node.target
    called = callee(node)
    if called is not None:
        return ("repeat", id(called), repeat_count(node)) if is_repeat(node) else ("call", id(called))
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return (getattr(target, "__module__", None), getattr(target, "__qualname__", repr(target)))


def _const_key(value: Any) -> Any:
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if isinstance(val, (tuple, list)):  # a call's results: each item's spec is in its getitem's signature
            return ("T", "results", len(val))
        return ("T", _spec(val))
    if isinstance(value, torch.Tensor):  # a tensor literal in the args: compare by value
        return ("tensor", _spec(value), value.detach().cpu().numpy().tobytes())
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
                          torch.layout)):
        return (type(value).__name__, repr(value))
    if isinstance(value, (tuple, list)):
        return tuple(_const_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _const_key(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", repr(value))
    return ("obj", id(value))


def local_signature(node: fx.Node) -> Any:
    """What ``node`` computes, independent of where its inputs come from."""
    if node.meta.get(OP) in _NEVER:
        return ("never", id(node))
    meta = node.meta
    return (_target_key(node), _const_key(node.args), _const_key(node.kwargs), _spec(meta.get("val")),
            bool(writes(node)), MODIFIES in meta, VIEW_OF in meta, bool(meta.get(IN_SEQUENCE)))


def _arg_nodes(node: fx.Node) -> list[fx.Node]:
    """Every node argument of ``node``, in argument order (repeats included)."""
    found: list[fx.Node] = []

    def record(a: fx.Node) -> fx.Node:
        found.append(a)
        return a

    fx.node.map_arg((node.args, node.kwargs), record)
    return found


def _ops(graph: Graph) -> list[fx.Node]:
    return [n for n in graph.fx.nodes if n.op == "call_function"]


# -- structure of one region ----------------------------------------------------------------
@dataclass
class _Region:
    nodes: list[fx.Node]
    externals: list[fx.Node]
    pattern: list[Any]
    written: set[int]        # indices into externals written in place
    used_outside: set[int]   # offsets of nodes read after the region


def _region(graph: Graph, nodes: list[fx.Node], returned: set[fx.Node]) -> _Region | None:
    """The wiring of ``nodes``; None when a write or alias reaches outside in a way calls cannot express."""
    offset = {n: j for j, n in enumerate(nodes)}
    externals: list[fx.Node] = []
    index: dict[fx.Node, int] = {}

    def ref(node: fx.Node, add: bool) -> Any:
        if node in offset:
            return ("i", offset[node])
        if node not in index:
            if not add:
                return None
            index[node] = len(externals)
            externals.append(node)
        return ("e", index[node])

    pattern, written = [], set()
    for n in nodes:
        refs = [ref(a, True) for a in _arg_nodes(n)]
        metas = []
        for key in _REFS:
            if n.meta.get(key) is not None:
                r = ref(n.meta[key], False)
                if r is None:
                    return None
                metas.append((key, r))
        written_refs = []
        for w in writes(n):
            r = ref(w, False)
            if r is None:
                return None
            if r[0] == "e":
                written.add(r[1])
            written_refs.append(r)
        pattern.append((tuple(refs), tuple(metas), tuple(written_refs)))
    if any(not isinstance(e.meta.get("val"), torch.Tensor) for e in externals):
        return None  # starts at the items of a call outside it: the call's tuple is no graph input
    used_outside = set()
    for j, n in enumerate(nodes):
        if n in returned or any(u not in offset for u in n.users):
            used_outside.add(j)
    return _Region(nodes, externals, pattern, written, used_outside)


def _meta_referenced_outside(graph: Graph, regions: list[_Region]) -> set[int]:
    """Offsets of region nodes that ops after the regions name in their alias/write metadata."""
    inside = {n: (i, j) for i, r in enumerate(regions) for j, n in enumerate(r.nodes)}
    found = set()
    for n in graph.fx.nodes:
        if n in inside:
            continue
        targets = [n.meta.get(k) for k in _REFS] + writes(n)
        for t in targets:
            if t in inside:
                found.add(inside[t][1])
    return found


# -- finding repeats ----------------------------------------------------------------------
def _weight(node: fx.Node) -> float:
    """What one op costs in compiled code: tuple items nothing, calls little."""
    if node.target is operator.getitem:
        return 0.0
    return CALL_COST if is_call(node) else 1.0


def _candidates(codes: np.ndarray, weights: np.ndarray, min_ops: int) -> list[tuple[float, int, int, int, int]]:
    """(savings, period, start, copies, slack) for every maximal periodic run, best first."""
    found = []
    n = len(codes)
    prefix = np.concatenate(([0.0], np.cumsum(weights)))
    real = np.concatenate(([0], np.cumsum(weights == 1.0)))
    for p in range(min_ops, n // 2 + 1):
        eq = codes[:-p] == codes[p:]
        if not eq.any():
            continue
        edges = np.diff(np.concatenate(([0], eq.astype(np.int8), [0])))
        for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
            k = (b - a) // p + 1
            if k >= 2:
                period_weight = prefix[a + p] - prefix[a]
                savings = _savings(period_weight, int(k))
                if savings > 0 and real[a + p] > real[a]:  # not just calls of graphs outlined before
                    found.append((savings, p, int(a), int(k), int((b - a) - (k - 1) * p)))
    found.sort(key=lambda c: (-c[0], c[1], c[2]))
    return found


def _savings(period_weight: float, copies: int) -> float:
    """Code removed by calling one graph ``copies`` times instead of inlining it."""
    return (copies - 1) * period_weight - copies * CALL_COST



def outline_graph(graph: Graph, min_ops: int = 2, max_tries: int = 64,
                  min_savings: float = MIN_SAVINGS) -> list[Graph]:
    """Replace repeated consecutive regions of ``graph`` by calls; return the new graphs.

    Args:
        graph: any graph of an IR (main graph or subgraph).
        min_ops: smallest region worth a call.
        max_tries: candidates examined per round before giving up.
        min_savings: smallest saving (op instances removed minus call costs) worth it.
    """
    created: list[Graph] = []
    # an op's signature outlives a round: replacing other ops' regions rewires its arguments
    # to call items of the same specs and renames its alias records, which signatures ignore
    known: dict[fx.Node, Any] = {}
    while True:
        ops = _ops(graph)
        signatures: dict[Any, int] = {}
        codes = np.array([signatures.setdefault(known[n] if n in known else known.setdefault(n, local_signature(n)),
                                                len(signatures)) for n in ops], dtype=np.int64)
        weights = np.array([_weight(n) for n in ops])
        done = False
        for savings, period, start, copies, slack in _candidates(codes, weights, min_ops)[:max_tries]:
            if savings < min_savings:
                break
            for shift in range(min(slack, period - 1) + 1):
                regions = _matching_regions(graph, ops, start + shift, period, copies)
                if regions is not None:
                    created.append(_replace(graph, regions))
                    done = True
                    break
            if done:
                break
        if not done:
            return created


def _matching_regions(graph: Graph, ops: list[fx.Node], start: int, period: int, copies: int) -> list[_Region] | None:
    returned = {t.node for t in graph.outputs}
    regions = []
    for i in range(copies):
        region = _region(graph, ops[start + i * period:start + (i + 1) * period], returned)
        if region is None:
            return None
        regions.append(region)
    first = regions[0]
    for r in regions[1:]:
        if r.pattern != first.pattern or len(r.externals) != len(first.externals):
            return None
    for r in regions:
        for e in r.externals:
            if e.op == "placeholder" and e.meta.get(ROLE) == Role.D2H:
                return None
    outside = set().union(*(r.used_outside for r in regions)) | _meta_referenced_outside(graph, regions)
    for r in regions:
        r.used_outside = outside
    return regions


def _replace(graph: Graph, regions: list[_Region]) -> Graph:
    """Build one graph from ``regions[0]`` and call it in place of every region."""
    first = regions[0]
    written = set().union(*(r.written for r in regions))
    outputs = sorted(first.used_outside)
    sub = graph.ir.new_subgraph(f"{graph.base_name}_block")
    env: dict[fx.Node, fx.Node] = {}
    for idx, ext in enumerate(first.externals):
        value = ext.meta["val"]
        name = ext.meta.get(NAME, ext.name)
        t = sub.add_input(TensorSpec(tuple(value.shape), value.dtype), str(name), by_ref=idx in written)
        env[ext] = t.node
    for n in first.nodes:
        env[n] = copy_node(n, sub.fx, env)
    sub.set_outputs([sub.wrap(env[first.nodes[j]]) for j in outputs])

    replaced: dict[fx.Node, fx.Node] = {}
    for region in regions:  # a later region reads an earlier one's outputs: now the call's items
        region.externals = [replaced.get(e, e) for e in region.externals]
        replaced.update(_call_in_place(graph, sub, region, outputs, written))
    return sub


def _call_in_place(graph: Graph, sub: Graph, region: _Region, outputs: list[int],
                   written: set[int]) -> dict[fx.Node, fx.Node]:
    """Call ``sub`` where ``region`` was; return {replaced region node: call output item}."""
    items = _insert_call(graph, sub, region, outputs, written)
    members = set(region.nodes)
    replacement = {region.nodes[j]: item for j, item in zip(outputs, items)}
    for old, item in replacement.items():
        old.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
    for n in graph.fx.nodes:  # alias/write metadata of later ops
        if n not in members:
            remap_records(n.meta, lambda w: replacement.get(w, w))
    for n in reversed(region.nodes):
        graph.fx.erase_node(n)
    graph.replace_body(graph.fx, replacement)  # Tensor handles (graph outputs, users' variables) follow
    return replacement


def _insert_call(graph: Graph, sub: Graph, region: _Region, outputs: list[int],
                 written: set[int]) -> list[fx.Node]:
    """Insert a call of ``sub`` on ``region``'s externals after its last op; return its output items."""
    fxg = graph.fx
    # after the region's last op: leaves it reads (variables made between its ops) exist by then
    with fxg.inserting_before(region.nodes[-1].next):
        call = fxg.call_function(CallTarget(sub), tuple(region.externals))
        items = []
        for o, j in enumerate(outputs):
            item = fxg.call_function(operator.getitem, (call, o))
            item.meta["val"] = region.nodes[j].meta["val"]
            item.meta[OP] = "output_of"
            if NAME in region.nodes[j].meta:
                item.meta[NAME] = region.nodes[j].meta[NAME]
            items.append(item)
    call.meta.update({
        "val": tuple(region.nodes[j].meta["val"] for j in outputs), OP: "call",
        CALLED_GRAPH: sub, OP_ID: graph.ir.next_op_id(),
        SOURCE: region.nodes[0].meta.get(SOURCE), OUTLINED: True,
    })
    if written:
        call.meta[BY_REF_ARGS] = set(written)
        roots = (storage_owner(region.externals[i], views=False) for i in sorted(written))
        call.meta[WRITES] = list(dict.fromkeys(roots))
    return items


# -- identical graphs ---------------------------------------------------------------------
def _graph_structure(graph: Graph) -> tuple[list[Any], list[str]]:
    """Comparable structure of a whole graph, and a readable line per item."""
    items: list[Any] = []
    lines: list[str] = []
    inputs = {t.node: i for i, t in enumerate(graph.inputs)}
    for t in graph.inputs:
        items.append(("input", _spec(t.node.meta.get("val")), bool(t.node.meta.get(BY_REF))))
        lines.append(f"input '{t.name}' {t.shape} {dtype_name(t.dtype)}{' by ref' if t.node.meta.get(BY_REF) else ''}")
    ops = _ops(graph)
    region = _region(graph, ops, {t.node for t in graph.outputs})
    if region is None:
        raise OutlineError(f"graph '{graph.name}' has writes or aliases the pass cannot follow",
                           fix="outline it by hand with ir.create_graph and ops.call")
    ext_keys = [_external_key(graph, e, inputs) for e in region.externals]
    for n, pattern in zip(ops, region.pattern):
        items.append((local_signature(n), pattern))
        lines.append(f"op '{n.name}' ({n.meta.get(OP, n.target)}) -> {_spec(n.meta.get('val'))}"
                     + (f" at {n.meta[SOURCE]}" if n.meta.get(SOURCE) else ""))
    items.append(("externals", tuple(ext_keys)))
    lines.append(f"inputs and constants read: {[e.name for e in region.externals]}")
    offset = {n: j for j, n in enumerate(ops)}
    outs = tuple(("op", offset[t.node]) if t.node in offset else ("input", inputs.get(t.node)) for t in graph.outputs)
    items.append(("outputs", outs))
    lines.append(f"outputs {[t.name for t in graph.outputs]}")
    return items, lines


def _external_key(graph: Graph, node: fx.Node, inputs: dict[fx.Node, int]) -> tuple[str, Any]:
    """How a graph's region reads ``node``: an input (by position), a constant (by value) or else."""
    if node in inputs:
        return ("input", inputs[node])
    if node.op == "get_attr":
        target = cast(str, node.target)
        value = graph.constant_data.get(target)
        return ("constant", _const_key(value)) if value is not None else ("attr", target)
    return ("other", node.name)


def deduplicate(graphs: Sequence[Graph]) -> Graph:
    """Make every call of ``graphs[1:]`` call ``graphs[0]``; they must be structurally identical.

    Raises:
        OutlineError: when a graph differs from the first (says the first difference).
    """
    graphs = list(graphs)
    if not graphs:
        raise OutlineError("deduplicate needs at least one graph", fix="pass the graphs to merge")
    keep = graphs[0]
    reference, lines = _graph_structure(keep)
    for other in graphs[1:]:
        if other.ir is not keep.ir:
            raise OutlineError(f"graphs '{keep.name}' and '{other.name}' belong to different IRs",
                               fix="outline graphs of one Ir")
        items, other_lines = _graph_structure(other)
        if items != reference:
            raise OutlineError(_difference(keep, other, reference, items, lines, other_lines),
                               fix="only identical graphs (same ops, shapes, dtypes, constants and wiring) can "
                                   "share one graph; make the differing part an input, or keep them separate")
    merged = set(graphs[1:])
    for graph in keep.ir.graphs:
        for node in call_nodes(graph):
            if callee(node) in merged:
                node.target = RepeatTarget(keep, repeat_count(node)) if is_repeat(node) else CallTarget(keep)
                node.meta[CALLED_GRAPH] = keep
    keep.ir.graphs[:] = [g for g in keep.ir.graphs if g not in merged]
    return keep


def _difference(a: Graph, b: Graph, ia: list, ib: list, la: list[str], lb: list[str]) -> str:
    for k, (x, y) in enumerate(zip(ia, ib)):
        if x != y:
            return (f"graphs '{a.name}' and '{b.name}' are not identical: item {k} differs: "
                    f"{la[k] if k < len(la) else x} vs {lb[k] if k < len(lb) else y}")
    return (f"graphs '{a.name}' and '{b.name}' are not identical: {len(ia)} vs {len(ib)} items "
            f"({len(_ops(a))} vs {len(_ops(b))} ops)")


def outline_ir(ir: "Ir", min_ops: int = 2, graphs: Iterable[Graph] | None = None,
               min_savings: float = MIN_SAVINGS) -> OutlineSummary:
    """Outline repeats inside every graph of ``ir`` (or of ``graphs``)."""
    summary = OutlineSummary(ops_before=_op_instances(ir))
    targets = list(graphs) if graphs is not None else list(ir.graphs)
    for graph in targets:
        for sub in outline_graph(graph, min_ops, min_savings=min_savings):
            summary.graphs.append(sub)
    summary.call_sites = sum(1 for g in ir.graphs for n in call_nodes(g) if callee(n) in summary.graphs)
    summary.ops_after = _op_instances(ir)
    return summary


def _op_instances(ir: "Ir") -> int:
    """Ops in compiled code: each graph counted once."""
    return sum(len(_ops(g)) for g in ir.graphs)


# -- the pass contract ------------------------------------------------------------------------
def outline(target: "Graph | Ir", min_ops: int = 2, min_savings: float = MIN_SAVINGS) -> PassResult:
    """Outline repeated regions of a graph (``outline_graph``) or of every graph of an IR
    (``outline_ir``), in place.

    Returns:
        ``PassResult(target, modified)``: modified when some region became calls of a new graph.
    """
    if isinstance(target, Graph):
        return PassResult(target, bool(outline_graph(target, min_ops, min_savings=min_savings)))
    return PassResult(target, bool(outline_ir(target, min_ops, min_savings=min_savings).graphs))


def merge_identical_graphs(graphs: Sequence[Graph]) -> PassResult:
    """``deduplicate(graphs)``: every call of ``graphs[1:]`` calls ``graphs[0]``.

    Returns:
        ``PassResult(graphs[0], modified)``: modified when another graph was merged into it.

    Raises:
        OutlineError: as ``deduplicate``.
    """
    kept = deduplicate(graphs)
    return PassResult(kept, any(g is not kept for g in graphs))
