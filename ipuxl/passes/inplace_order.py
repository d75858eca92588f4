"""In-place order: which ops must keep their program order, and which reads are ambiguous.

fx graphs carry data edges only (docs/architecture.md, "Traps in torch.fx"): a read of a
tensor and an in-place write of its storage may have no edge between them, and then
only program order says which runs first. ipuxl's meaning is program order; this pass
makes that order explicit as extra edges (:func:`side_effect_constraints`), so a
reordering pass (``passes.schedule``) keeps results, and checks that the order is not
*only* program order where PopXL would leave it to its scheduler
(:func:`verify_inplace_order`).

Side effects (what an op does besides computing its outputs):

- in-place writes: ``WRITES`` (``ipuxl.ir.aliases.writes``: var_updates, ``scaled_add_``,
  ``copy_var_update_``, in-place collectives, and calls whose callee modifies a
  by-reference input: ``BY_REF_ARGS``). A callee that modifies an input passed
  *by value* writes a clone that lowering makes at the call, so that call is a plain
  read of the caller's tensor;
- host stores (``host_store`` writes its d2h slot; stores keep their order);
- collectives (``ipuxl.ir.meta.COLLECTIVE_OPS``, and calls of graphs that
  contain one): every replica must meet in the same order, so they keep their order;
- ops built under ``with ipuxl.in_sequence():`` keep their relative order.

Random ops are pure functions of a seed tensor here (no hidden state is advanced), so
they add no constraint.

Storage (``ipuxl.ir.aliases``). Two tensors share storage when one is an in-place
result (``MODIFIES``) or a view (``VIEW_OF``) of the other. A view that an in-place
op writes through is copied by lowering (PopXL's view ops return new tensors), so it
is a storage of its own: ``storage_owner(node, copied=<written views>)``; any other
view counts as its source (when lowering copies it, keeping it ordered with its
source's writes is still right).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from ipuxl.errors import InplaceOrderError
from ipuxl.ir.aliases import storage_owner, writes, written_nodes
from ipuxl.ir.calls import any_reachable, callee
from ipuxl.ir.meta import COLLECTIVE_OPS, IN_SEQUENCE, NAME, OP, SOURCE

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir

__all__ = ["side_effect_constraints", "verify_inplace_order", "ambiguous_pairs", "StorageAccess", "storage_accesses"]

_LEAVES = ("placeholder", "get_attr", "output")


class StorageAccess:
    """Which written storages each op of a graph reads and writes (program order).

    Attributes:
        nodes: the graph's ops (no placeholders, get_attr or output), program order.
        written: storage roots that some op writes in place.
        reads: op -> written storage roots it reads (through any alias); writes count too.
        writes: op -> storage roots it writes.
    """

    def __init__(self, graph: "Graph"):
        self.nodes = [n for n in graph.fx.nodes if n.op not in _LEAVES]
        self._written_nodes = written_nodes(self.nodes)  # a written view owns its storage: lowering copies it
        self.writes: dict[fx.Node, list[fx.Node]] = {}
        for node in self.nodes:
            roots = []
            for w in writes(node):
                root = self.storage_of(w)
                if root not in roots:
                    roots.append(root)
            if roots:
                self.writes[node] = roots
        self.written = {r for roots in self.writes.values() for r in roots}
        self.reads: dict[fx.Node, set[fx.Node]] = {}
        for node in self.nodes:
            read = {self.storage_of(a) for a in node.all_input_nodes} & self.written
            read.update(self.writes.get(node, ()))
            if read:
                self.reads[node] = read

    def storage_of(self, node: fx.Node) -> fx.Node:
        """The node owning the storage ``node``'s value lives in (see the module docstring)."""
        return storage_owner(node, copied=self._written_nodes)


def storage_accesses(graph: "Graph") -> StorageAccess:
    """Reads and writes of written storages per op of ``graph``."""
    return StorageAccess(graph)


def _is_collective_op(node: fx.Node) -> bool:
    return node.meta.get(OP) in COLLECTIVE_OPS


def _is_collective(node: fx.Node, cache: dict["Graph", bool]) -> bool:
    """True for a collective, or a call of a graph that (directly or not) contains one."""
    if _is_collective_op(node):
        return True
    called = callee(node)
    if called is None:
        return False
    if called not in cache:
        cache[called] = any_reachable(called, _is_collective_op)
    return cache[called]


def side_effect_constraints(graph: "Graph") -> dict[fx.Node, set[fx.Node]]:
    """For every node of ``graph``, the nodes that must run before it beyond its data inputs.

    Keeps ipuxl's meaning (program order) for everything that touches written storage:

    1. every read of a storage stays after the write before it (write-before-read) and
       before the write after it (read-before-write); writes to one storage keep their
       order (each write follows the previous write and every read since);
    2. ops marked ``in_sequence`` keep their relative order;
    3. collectives (and calls of graphs containing one) keep their relative order;
    4. host stores keep their relative order.

    Only the edges between neighbours are listed (the rest follows transitively), and
    a node's direct data inputs are left out. Pure ops that touch no written storage
    get an empty set: a scheduler may move them freely.
    """
    access = StorageAccess(graph)
    preds: dict[fx.Node, set[fx.Node]] = {n: set() for n in graph.fx.nodes}
    last_write: dict[fx.Node, fx.Node] = {}
    reads_since: dict[fx.Node, list[fx.Node]] = {}
    chains: dict[str, fx.Node] = {}
    collective_cache: dict["Graph", bool] = {}
    for node in access.nodes:
        before = preds[node]
        # 1. storage order
        writes = access.writes.get(node, ())
        for root in access.reads.get(node, ()):
            if root in last_write:
                before.add(last_write[root])
        for root in writes:
            before.update(reads_since.get(root, ()))
            last_write[root] = node
            reads_since[root] = []
        for root in access.reads.get(node, ()):
            if root not in writes:
                reads_since.setdefault(root, []).append(node)
        # 2-4. total orders of in_sequence ops, collectives and host stores
        kinds = []
        if node.meta.get(IN_SEQUENCE):
            kinds.append("in_sequence")
        if _is_collective(node, collective_cache):
            kinds.append("collective")
        if node.meta.get(OP) == "host_store":
            kinds.append("host_store")
        for kind in kinds:
            if kind in chains:
                before.add(chains[kind])
            chains[kind] = node
        before.discard(node)
        before.difference_update(node.all_input_nodes)
    return preds


# -- the verifier ------------------------------------------------------------------------
def verify_inplace_order(graph: "Graph | Ir") -> None:
    """Raise when a read of a tensor and an in-place write of its storage are unordered.

    A read R and a write M of the same storage (any alias or view of it) are
    *ambiguous* when no data path joins them in either direction (R does not reach M,
    M does not reach R) and they are not both ``in_sequence`` ops. ipuxl runs them in
    program order, but PopXL's scheduler may run them either way, so the program's
    answer is not portable. Two writes of one storage are checked the same way.

    Args:
        graph: a graph, or an ``Ir`` (every graph is checked).

    Raises:
        InplaceOrderError: naming both ops (op, node, tensor, source line) and the fix.
    """
    graphs = graph.graphs if hasattr(graph, "graphs") else [graph]
    for g in graphs:
        found = ambiguous_pairs(g)
        if found:
            raise _error(g, *found[0], more=len(found) - 1)


def ambiguous_pairs(graph: "Graph") -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """``(read, write, storage root)`` for every ambiguous pair of ``graph``, program order."""
    access = StorageAccess(graph)
    if not access.written:
        return []
    ancestors = _ancestor_bits(graph)
    bit = {n: 1 << i for i, n in enumerate(graph.fx.nodes)}
    writers: dict[fx.Node, list[fx.Node]] = {}
    for node, roots in access.writes.items():
        for root in roots:
            writers.setdefault(root, []).append(node)
    found = []
    seen_pairs: set[tuple[fx.Node, fx.Node]] = set()
    for read in access.nodes:
        for root in sorted(access.reads.get(read, ()), key=lambda r: r.name):
            for write in writers.get(root, ()):
                if write is read or (write, read) in seen_pairs or (read, write) in seen_pairs:
                    continue
                if ancestors[write] & bit[read] or ancestors[read] & bit[write]:
                    continue
                if read.meta.get(IN_SEQUENCE) and write.meta.get(IN_SEQUENCE):
                    continue
                seen_pairs.add((read, write))
                found.append((read, write, root))
    return found


def _ancestor_bits(graph: "Graph") -> dict[fx.Node, int]:
    """Data-edge ancestors of every node, as bit sets over program positions."""
    bit = {n: 1 << i for i, n in enumerate(graph.fx.nodes)}
    ancestors: dict[fx.Node, int] = {}
    for node in graph.fx.nodes:
        acc = 0
        for arg in node.all_input_nodes:
            acc |= ancestors[arg] | bit[arg]
        ancestors[node] = acc
    return ancestors


def _tensor_name(node: fx.Node) -> str:
    return node.meta.get(NAME, node.name)


def _describe_op(node: fx.Node) -> str:
    op = node.meta.get(OP, getattr(node.target, "__name__", str(node.target)))
    source = node.meta.get(SOURCE) or "unknown source line"
    return f"op '{op}' (node '{node.name}', at {source})"


def _error(graph: "Graph", read: fx.Node, write: fx.Node, root: fx.Node, more: int) -> InplaceOrderError:
    order = {n: i for i, n in enumerate(graph.fx.nodes)}
    read_first = order[read] < order[write]
    tensor = _tensor_name(root)
    what = (f"ambiguous read of '{tensor}' in graph '{graph.name}': {_describe_op(read)} reads '{tensor}' "
            f"and {_describe_op(write)} writes it in place, with no data path between them; ipuxl runs "
            f"them in program order (the {'read' if read_first else 'write'} first), but PopXL's scheduler "
            f"may run them in either order")
    if more:
        what += f" ({more} more ambiguous pair{'s' if more > 1 else ''} in this graph)"
    if read_first:
        fix = ("build both ops under `with ipuxl.in_sequence():` to keep program order, or make the "
               "write depend on the read")
    else:
        fix = ("read the tensor returned by the in-place op (e.g. `w = ops.scaled_add_(w, ...)`, then use "
               f"that `w`) instead of '{tensor}', or build both ops under `with ipuxl.in_sequence():`")
    return InplaceOrderError(what, where=read.meta.get(SOURCE), fix=fix)
