"""Several IPUs: the memory, FLOPs and copies of each IPU a program uses.

Every op and variable has an IPU (``ipuxl.ir.placement``; absent: IPU 0). Each IPU
has its own memory (``IpuSpec.memory_bytes``), so a program placed on N IPUs fits
when each IPU's share fits. ``ipu_report(ir)`` accounts, per IPU of one replica:

* **variables**: the variables placed on it (an unplaced one: on the IPU of its first
  reader); **constants**: on the IPU of their first reader;
* **code**: its main-graph ops, plus every graph its calls reach, once per IPU (a
  graph called on two IPUs is compiled on both), sized as ``resources`` does;
* **peak activations**: the main graph's live activations (memory schedule) whose
  producer is on it, plus a callee's own peak while a call on it runs;
* **stream buffers**: one slot per stream its ops (or its calls) load or store;
* **FLOPs** of one ``Session.run`` and the **cross-IPU copy bytes** it sends and
  receives (``ops.ipu_copy``, counted per execution);
* for a pipelined program (calls recorded with ``PIPELINE_STAGE``), the pipeline
  schedule (``ipuxl.device.pipeline``) and each IPU's idle fraction.

``check_each_ipu`` raises ``OutOfMemoryError`` naming the first IPU that does not fit
(``resources.check_fits`` calls it for programs on several IPUs). A subgraph runs on
the IPU of the op that calls it; its own ops' placement is not used here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.fx as fx

from ipuxl.device.pipeline import PipelineSchedule, pipeline_schedule
from ipuxl.device.report import format_flops, graph_flops, node_flops
from ipuxl.device.resources import IpuSpec, call_sites, code_nodes, describe_node, get_spec, graph_code_bytes, mib
from ipuxl.errors import OutOfMemoryError
from ipuxl.ir.aliases import storage_owner
from ipuxl.ir.calls import callee, reachable_from, repeat_count, transfer_counts
from ipuxl.ir.meta import OP, PIPELINE_STAGE, ROLE, STREAM, Role
from ipuxl.ir.placement import ipu_of, num_ipus
from ipuxl.passes.liveness import live_profile, node_bytes, tensor_bytes

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


def _activations(graph: "Graph", usages: list[IpuUsage]) -> None:
    """Per-IPU peak of the main graph's live activations (``passes.liveness``' rules)."""
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
    live = [0] * len(usages)
    frees: dict[int, list[tuple[int, int]]] = {}
    peaks: dict["Graph", int] = {}
    for i, node in enumerate(nodes):
        ipu, size = _ipu(node), node_bytes(node)
        live[ipu] += size
        if size:
            frees.setdefault(last_use.get(node, i), []).append((ipu, size))
        called = callee(node)
        transient = 0
        if called is not None:
            if called not in peaks:
                peaks[called] = live_profile(called).peak_bytes
            transient = peaks[called]
        if live[ipu] + transient > usages[ipu].activation_bytes:
            usages[ipu].activation_bytes, usages[ipu].peak_op = live[ipu] + transient, describe_node(node)
        for where, freed in frees.pop(i, []):
            live[where] -= freed


def ipu_report(ir: "Ir", spec: IpuSpec | None = None) -> IpuReport:
    """Per-IPU memory, FLOPs, copies and pipeline schedule of ``ir`` (one replica)."""
    spec = get_spec(spec)
    main = ir.main_graph
    usages = [IpuUsage(i) for i in range(num_ipus(ir))]
    sites = call_sites(ir)
    compiled: list[set["Graph"]] = [set() for _ in usages]
    streams: list[set[Stream]] = [set() for _ in usages]
    memo: dict["Graph", int] = {}
    for node in main.fx.nodes:
        usage = usages[_ipu(node)]
        called = callee(node)
        if node.op == "get_attr":
            size = tensor_bytes(node.meta.get("val"))
            if ipu_of(node) is None:  # unplaced: on the IPU of the op that reads it first
                usage = usages[_ipu(next(iter(node.users)))] if node.users else usages[0]
            if node.meta.get(ROLE) == Role.VARIABLE:
                usage.variable_bytes, usage.num_variables = usage.variable_bytes + size, usage.num_variables + 1
            else:
                usage.constant_bytes += size
        elif called is not None:
            compiled[usage.ipu].update(reachable_from([called]))
            streams[usage.ipu].update(transfer_counts(called))
            usage.flops += repeat_count(node) * graph_flops(called, memo)
        else:
            usage.flops += node_flops(node)
            if node.meta.get(ROLE) in Role.STREAMS and STREAM in node.meta:
                streams[usage.ipu].add(node.meta[STREAM])
    for node in code_nodes(main):
        usages[_ipu(node)].code_ops += 1
    for usage in usages:
        usage.code_bytes = usage.code_ops * spec.code_bytes_per_op
        for graph in compiled[usage.ipu]:
            g_code, g_ops, _ = graph_code_bytes(graph, sites, spec)
            usage.code_bytes, usage.code_ops = usage.code_bytes + g_code, usage.code_ops + g_ops
        usage.stream_bytes = sum(tensor_bytes(s.spec.to_meta()) for s in streams[usage.ipu])
    _activations(main, usages)
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
