"""Several IPUs: the memory, FLOPs and copies of each IPU a program uses.

Every op and variable has an IPU (``ipuxl.ir.placement``; absent: IPU 0). Each IPU
has its own memory (``IpuSpec.memory_bytes``), so a program placed on N IPUs fits
when each IPU's share fits. ``ipu_report(ir)`` does the accounting.

It descends from the main graph into every graph its calls and repeats run
(once per graph and IPU of its caller) and charges each node to **its own IPU**: its
``IPU`` meta, else the IPU of its first placed input (an unplaced optimiser update runs
with its weight), else that of its first reader (a host load feeds the stage that reads
it), else its caller's IPU. So a PopTorch program, whose stages run inside the main
graph's ``repeat`` body, is split as its blocks are. Per IPU of one replica:

* **variables** and **constants** of every compiled graph, once each (a variable stored
  off-chip by its tensor location counts in ``offchip_bytes``, not on-chip);
* **code**: the op instances charged to it, once per (op, IPU) (a graph called on two IPUs
  is compiled on both), plus the outlined call sites it runs, sized as ``resources`` does;
  summed over the IPUs it is ``resources.estimate``'s code of a program whose graphs run
  on one IPU each;
* **peak activations**: the live activations charged to it (memory schedule), plus a
  callee's own per-IPU peak while a call runs;
* **stream buffers**: one slot per stream its nodes load or store;
* **FLOPs** of one ``Session.run`` and the **cross-IPU copy bytes** it sends and
  receives (``ops.ipu_copy``, counted per execution);
* for a pipelined program (calls recorded with ``PIPELINE_STAGE``), the pipeline
  schedule (``ipuxl.device.pipeline``) and each IPU's idle fraction.

``check_each_ipu`` raises ``OutOfMemoryError`` naming the first IPU that does not fit
(``resources.check_fits`` calls it for programs on several IPUs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.fx as fx

from ipuxl.device.pipeline import PipelineSchedule, pipeline_schedule
from ipuxl.device.report import format_flops, node_flops
from ipuxl.device.resources import (
    IpuSpec, call_sites, code_nodes, describe_node, get_spec, held_bytes, is_inlined, mib, tensor_locations,
)
from ipuxl.errors import OutOfMemoryError
from ipuxl.ir.aliases import storage_owner
from ipuxl.ir.calls import callee, is_host_transfer, repeat_count
from ipuxl.ir.meta import IPU, OP, PIPELINE_STAGE, ROLE, STREAM, Role
from ipuxl.ir.placement import ipu_of, num_ipus
from ipuxl.passes.liveness import node_bytes, tensor_bytes

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir
    from ipuxl.ir.streams import Stream

__all__ = ["IpuUsage", "IpuReport", "ipu_report", "check_each_ipu", "num_ipus", "copy_bytes", "pipeline_of"]


@dataclass
class IpuUsage:
    """One IPU of one replica: memory (bytes), FLOPs and copies per ``Session.run``."""

    ipu: int
    variable_bytes: int = 0
    num_variables: int = 0
    constant_bytes: int = 0
    code_bytes: int = 0
    code_ops: int = 0
    activation_bytes: int = 0
    peak_op: str = "no op"
    stream_bytes: int = 0
    flops: int = 0
    copy_out_bytes: int = 0
    copy_in_bytes: int = 0
    idle_fraction: float | None = None
    offchip_bytes: int = 0
    """Its variables stored in Streaming Memory by their tensor location (not in ``total_bytes``)."""

    @property
    def total_bytes(self) -> int:
        return self.variable_bytes + self.constant_bytes + self.code_bytes + self.activation_bytes + self.stream_bytes

    def components(self) -> list[tuple[str, int, str]]:
        return [("variables", self.variable_bytes, f"{self.num_variables} tensors"),
                ("constants", self.constant_bytes, "read by its ops"),
                ("code", self.code_bytes, f"{self.code_ops} op instances"),
                ("peak activations", self.activation_bytes, f"at {self.peak_op}"),
                ("stream buffers", self.stream_bytes, "one slot per stream")]


@dataclass
class IpuReport:
    """Per-IPU accounting of a program (see the module docstring); ``str()`` is a table."""

    spec: IpuSpec
    ipus: list[IpuUsage]
    copies: dict[tuple[int, int], int] = field(default_factory=dict)
    """(source IPU, destination IPU) -> bytes copied per ``Session.run``."""
    schedule: PipelineSchedule | None = None
    stage_ipus: dict[int, int] = field(default_factory=dict)

    def usage(self, ipu: int) -> IpuUsage:
        return self.ipus[ipu]

    def check(self, where: str | None = None) -> None:
        """Raise ``OutOfMemoryError`` naming the first IPU whose share does not fit."""
        available = self.spec.memory_bytes
        for usage in self.ipus:
            if usage.total_bytes <= available:
                continue
            rows = "\n".join(f"  {name + ':':<18} {mib(size):>8} MiB  ({detail})"
                             for name, size, detail in usage.components())
            raise OutOfMemoryError(
                f"IPU {usage.ipu} of {len(self.ipus)} is out of memory: the ops and variables placed on it need "
                f"{mib(usage.total_bytes)} MiB, the IPU has {mib(available)} MiB ({self.spec.describe()}), "
                f"{mib(usage.total_bytes - available)} MiB too much\n{rows}",
                where=where,
                fix=f"move some layers from IPU {usage.ipu} to another IPU (popxl.ipu(n) / poptorch.BeginBlock), "
                    "recompute activations, or run with device 'cpu' (no memory limit)")

    def __str__(self) -> str:
        header = ("IPU", "memory MiB", "variables", "code", "activations", "FLOPs/run", "copy out", "copy in", "idle")
        rows = [header]
        for u in self.ipus:
            idle = "-" if u.idle_fraction is None else f"{100 * u.idle_fraction:.0f}%"
            rows.append((str(u.ipu), mib(u.total_bytes), mib(u.variable_bytes), mib(u.code_bytes),
                         mib(u.activation_bytes), format_flops(u.flops), _kib(u.copy_out_bytes),
                         _kib(u.copy_in_bytes), idle))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [f"IPUs: {len(self.ipus)} (memory of each: {mib(self.spec.memory_bytes)} MiB; sizes in MiB, "
                 "copies in KiB per Session.run)"]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        if any(u.offchip_bytes for u in self.ipus):
            lines.append("Off-chip variables (tensor locations, Streaming Memory): " + ", ".join(
                f"IPU {u.ipu}: {mib(u.offchip_bytes)} MiB" for u in self.ipus if u.offchip_bytes))
        if self.copies:
            lines.append("Cross-IPU copies per Session.run: " + ", ".join(
                f"IPU {s} -> IPU {d}: {_kib(b)} KiB" for (s, d), b in sorted(self.copies.items())))
        if self.schedule is not None:
            s = self.schedule
            lines += [f"Pipeline: {s.stages} stages x {s.micro_batches} micro-batches, {len(s.cycles)} cycles "
                      f"(ramp-up {s.stages - 1}, steady {s.micro_batches - s.stages + 1}, ramp-down {s.stages - 1})",
                      s.format(self.stage_ipus)]
        return "\n".join(lines)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def _ipu(node: fx.Node) -> int:
    found = ipu_of(node)
    return 0 if found is None else found


def copy_bytes(graph: "Graph", times: int = 1, _out: dict[tuple[int, int], int] | None = None
               ) -> dict[tuple[int, int], int]:
    """(source, destination) -> bytes ``ops.ipu_copy`` moves in ``times`` runs of ``graph``
    (callees included, per execution)."""
    out = {} if _out is None else _out
    for node in graph.fx.nodes:
        called = callee(node)
        if called is not None:
            copy_bytes(called, times * repeat_count(node), out)
        elif node.meta.get(OP) == "ipu_copy" and len(node.args) >= 3:
            source, destination = node.args[1], node.args[2]
            assert isinstance(source, int) and isinstance(destination, int), "ipu_copy records both IPUs"
            key = (source, destination)
            out[key] = out.get(key, 0) + times * tensor_bytes(node.meta.get("val"))
    return out


def pipeline_of(graph: "Graph") -> tuple[PipelineSchedule, dict[int, int]] | None:
    """The pipeline of ``graph``'s stage calls (``PIPELINE_STAGE``) and each stage's IPU, if any."""
    calls = [n for n in graph.fx.nodes if n.meta.get(PIPELINE_STAGE) is not None and callee(n) is not None]
    if not calls:
        return None
    stages = max(int(n.meta[PIPELINE_STAGE]) for n in calls) + 1
    micro_batches = sum(1 for n in calls if n.meta[PIPELINE_STAGE] == 0)
    stage_ipus = {int(n.meta[PIPELINE_STAGE]): _ipu(n) for n in calls}
    return pipeline_schedule(stages, max(micro_batches, 1)), stage_ipus


def _placement(graph: "Graph", default: int) -> dict[fx.Node, int]:
    """The IPU of each node of ``graph`` when the graph runs on IPU ``default``.

    A node's own ``IPU`` meta wins. An unplaced op runs where its inputs are (the first
    placed one: the optimiser's update of a weight runs on the weight's IPU, a tuple item
    where its op ran); a node still unplaced (a host load, a slice of it, a graph input,
    a constant) lives where its first reader runs (the source IPU of an ``ipu_copy``);
    anything else on ``default``, the IPU of the call that runs the graph.
    """
    found: dict[fx.Node, int] = {}
    nodes = list(graph.fx.nodes)
    for node in nodes:
        own = node.meta.get(IPU)
        if own is not None:
            found[node] = int(own)
        elif node.op == "call_function":
            placed = [found[n] for n in node.all_input_nodes if n in found]
            if placed:
                found[node] = placed[0]
    for node in reversed(nodes):
        if node in found or node.op == "output":
            continue
        for user in node.users:
            if user.meta.get(OP) == "ipu_copy" and len(user.args) >= 2 and isinstance(user.args[1], int):
                found[node] = user.args[1]
                break
            if user in found:
                found[node] = found[user]
                break
    for node in nodes:
        found.setdefault(node, default)
    return found


@dataclass
class _Context:
    """One graph run on one IPU: where its nodes are and what one execution costs per IPU."""

    where: dict[fx.Node, int]
    flops: dict[int, int]
    peaks: dict[int, tuple[int, str]]


class _Walk:
    """Descends from the main graph into every called graph (repeat bodies, calls), once per
    (graph, IPU of its caller), charging each node to its own IPU (``_placement``)."""

    def __init__(self, ir: "Ir", spec: IpuSpec, usages: list[IpuUsage]):
        self.spec, self.usages, self.sites = spec, usages, call_sites(ir)
        self.locations = tensor_locations(ir)
        self.contexts: dict[tuple["Graph", int], _Context] = {}
        self.code: set[tuple[fx.Node, int]] = set()
        self.call_code: set[tuple[fx.Node, int]] = set()
        self.attrs: set[fx.Node] = set()
        self.streams: list[set["Stream"]] = [set() for _ in usages]

    def _usage(self, ipu: int) -> IpuUsage:
        while ipu >= len(self.usages):  # a subgraph op placed beyond num_ipus cannot happen; stay safe
            self.usages.append(IpuUsage(len(self.usages)))
            self.streams.append(set())
        return self.usages[ipu]

    def visit(self, graph: "Graph", default: int) -> _Context:
        key = (graph, default)
        if key in self.contexts:
            return self.contexts[key]
        where = _placement(graph, default)
        context = _Context(where, {}, {})
        self.contexts[key] = context  # recursion guard
        code = {n for n in code_nodes(graph)}
        for node in graph.fx.nodes:
            ipu = where[node]
            called = callee(node)
            if node.op == "get_attr" and node not in self.attrs:
                self.attrs.add(node)
                stored = self.locations.get(node)
                usage, size = self._usage(ipu), held_bytes(node, stored)
                if stored is not None and stored.offchip:
                    usage.offchip_bytes += size
                elif node.meta.get(ROLE) == Role.VARIABLE:
                    usage.variable_bytes, usage.num_variables = usage.variable_bytes + size, usage.num_variables + 1
                else:
                    usage.constant_bytes += size
            elif called is not None:
                if not is_inlined(called, self.sites):
                    self.call_code.add((node, ipu))
                sub = self.visit(called, ipu)
                for where_, flops in sub.flops.items():
                    context.flops[where_] = context.flops.get(where_, 0) + repeat_count(node) * flops
            else:
                flops = node_flops(node)
                if flops:
                    context.flops[ipu] = context.flops.get(ipu, 0) + flops
                if node in code:
                    self.code.add((node, ipu))
            if is_host_transfer(node):
                self._usage(ipu)
                self.streams[ipu].add(node.meta[STREAM])
        context.peaks = self._activations(graph, where)
        return context

    def _activations(self, graph: "Graph", where: dict[fx.Node, int]) -> dict[int, tuple[int, str]]:
        """Per-IPU peak of the graph's live activations (``passes.liveness``' rules, memory
        schedule); a call adds its callee's own per-IPU peaks while it runs."""
        from ipuxl.passes.schedule import memory_schedule

        nodes = [n for n in memory_schedule(graph) if n.op not in ("placeholder", "get_attr", "output")]
        position = {n: i for i, n in enumerate(nodes)}
        last_use: dict[fx.Node, int] = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                root = storage_owner(arg)
                last_use[root] = max(last_use.get(root, -1), position.get(node, -1))
        for t in graph.outputs:
            last_use[storage_owner(t.node)] = len(nodes)
        live: dict[int, int] = {}
        frees: dict[int, list[tuple[int, int]]] = {}
        peaks: dict[int, tuple[int, str]] = {}
        for i, node in enumerate(nodes):
            ipu, size = where[node], node_bytes(node)
            live[ipu] = live.get(ipu, 0) + size
            if size:
                frees.setdefault(last_use.get(node, i), []).append((ipu, size))
            called = callee(node)
            transient = self.visit(called, ipu).peaks if called is not None else {}
            for at in set(live) | set(transient):
                total = live.get(at, 0) + transient.get(at, (0, ""))[0]
                if total > peaks.get(at, (0, ""))[0]:
                    inner = transient.get(at)
                    peaks[at] = (total, inner[1] if inner and inner[0] else describe_node(node))
            for at, freed in frees.pop(i, []):
                live[at] -= freed
        return peaks

    def finish(self, main: _Context) -> None:
        spec = self.spec
        for node, ipu in self.code:
            usage = self._usage(ipu)
            usage.code_ops += 1
            usage.code_bytes += spec.code_bytes_per_op
        for _, ipu in self.call_code:
            self._usage(ipu).code_bytes += spec.code_bytes_per_call_site
        for usage, streams in zip(self.usages, self.streams):
            usage.stream_bytes = sum(tensor_bytes(s.spec.to_meta()) for s in streams)
        for ipu, flops in main.flops.items():
            self._usage(ipu).flops = flops
        for ipu, (peak, at) in main.peaks.items():
            usage = self._usage(ipu)
            usage.activation_bytes, usage.peak_op = peak, at


def ipu_report(ir: "Ir", spec: IpuSpec | None = None) -> IpuReport:
    """Per-IPU memory, FLOPs, copies and pipeline schedule of ``ir`` (one replica)."""
    spec = get_spec(spec)
    main = ir.main_graph
    usages = [IpuUsage(i) for i in range(num_ipus(ir))]
    walk = _Walk(ir, spec, usages)
    walk.finish(walk.visit(main, 0))
    copies = copy_bytes(main)
    for (source, destination), size in copies.items():
        if source < len(usages):
            usages[source].copy_out_bytes += size
        if destination < len(usages):
            usages[destination].copy_in_bytes += size
    report = IpuReport(spec, usages, copies)
    pipeline = pipeline_of(main)
    if pipeline is not None:
        report.schedule, report.stage_ipus = pipeline
        for ipu, idle in report.schedule.idle_fraction(report.stage_ipus).items():
            if ipu < len(usages):
                usages[ipu].idle_fraction = idle
    return report


def check_each_ipu(ir: "Ir", spec: IpuSpec | None = None, where: str | None = None) -> IpuReport:
    """``ipu_report(ir, spec)``, raising ``OutOfMemoryError`` naming an IPU that does not fit."""
    report = ipu_report(ir, spec)
    report.check(where)
    return report
