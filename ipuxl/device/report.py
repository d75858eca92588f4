"""A program report: what an IR compiles to and what one step costs.

``program_report(ir)`` (or ``Session.report()``) gives a ``ProgramReport``:

* per graph: the op-type histogram, how it is compiled (main, inlined into its one
  caller, outlined = one shared function, loop body, or not compiled), its code size
  (``ipuxl.device.resources``: an outlined graph's code exists once), its call sites
  (which call/repeat nodes call it, from which graph) and the FLOPs of one execution;
* the memory of one replica / IPU (``resources.estimate``: variables, code, peak
  activations, stream buffers, against the ``IpuSpec``);
* FLOPs: matmul-like ops (matmul, mm, bmm, addmm, baddbmm, linear) 2*M*N*K,
  convolutions 2 * output elements * (input channels / groups) * kernel size (the
  backward: that per computed gradient), views, tuple items and host transfers 0,
  every other op ~1 FLOP per element of the largest tensor it reads or writes.
  FLOPs are executed work, so a called graph counts once per call site and
  ``repeat_count`` times per loop. Per ``Session.run`` (one run of the main program,
  the device loop included), per step (one host transfer: the run's FLOPs /
  ``num_host_transfers``) and per run over all replicas.
* Streaming Memory (``resources.remote_traffic``): per step, the bytes loaded and stored
  remotely (and code loaded), the time that exchange takes at
  ``IpuSpec.streaming_memory_bandwidth`` next to the compute estimate (FLOPs per step
  at ``IpuSpec.flops_per_second``), and the on-chip peak (the memory total above, whose
  peak activations include the tensors loaded for the largest phase).

``str(report)`` is a readable table. ``python benchmarks/program_report.py [--blocks N]
[--outlined]`` prints the report of a small MLP training program (popxl.addons style,
seed 002's model by default) without needing data.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence, cast

import torch
import torch.fx as fx

from ipuxl.device.resources import (
    CallSite, IpuSpec, RemoteTraffic, ResourceEstimate, call_sites, estimate, graph_code_bytes, is_inlined, is_op,
    mib, op_type, remote_traffic,
)
from ipuxl.ir.aliases import is_view
from ipuxl.ir.calls import callee, is_call, reachable_graphs, repeat_count
from ipuxl.passes.liveness import live_profile

if TYPE_CHECKING:
    from ipuxl.device.ipus import IpuReport
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir

__all__ = ["GraphReport", "ProgramReport", "program_report", "node_flops", "graph_flops", "format_flops"]

_MATMULS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "linear", "addmm_", "baddbmm_"}
_CONVS = {"conv", "convolution", "conv1d", "conv2d", "conv3d", "_convolution"}
_TRANSPOSED_CONVS = {"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
_NO_FLOPS = {"host_load", "host_store", "remote_load", "remote_load_", "remote_store", "remote_code_load", "copy", "copy_", "clone", "detach", "copy_var_update_", "output_of",
             "empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "expand", "contiguous",
             "cast", "to", "_to_copy", "alias", "lift_fresh_copy"}


# -- FLOPs ------------------------------------------------------------------------------
def _tensor_args(node: fx.Node) -> list[torch.Tensor]:
    values = []
    for arg in node.all_input_nodes:
        value = arg.meta.get("val")
        if isinstance(value, torch.Tensor):
            values.append(value)
    return values


def _numel(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return math.prod(value.shape)
    if isinstance(value, (tuple, list)):
        return max((_numel(v) for v in value), default=0)
    return 0


def _name(node: fx.Node) -> str:
    """The op's name without overload suffix or namespace, for the FLOP rules."""
    target = node.target
    name = getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)
    return str(name).split(".")[0]


def node_flops(node: fx.Node) -> int:
    """FLOPs of one op (not counting called graphs; see the module docstring)."""
    if not is_op(node) or is_view(node) or is_call(node):
        return 0
    kinds = {_name(node), op_type(node)}
    if kinds & _NO_FLOPS or node.op == "placeholder":
        return 0
    out = node.meta.get("val")
    args = _tensor_args(node)
    if kinds & _MATMULS:
        operands = args[1:] if kinds & {"addmm", "baddbmm", "addmm_", "baddbmm_"} else args
        if operands:
            k = operands[0].shape[-1] if operands[0].dim() else 1
            return 2 * _numel(out) * int(k)
    if kinds & (_CONVS | _TRANSPOSED_CONVS) and len(args) >= 2:
        weight = args[1]
        transposed = bool(kinds & _TRANSPOSED_CONVS) or (
            "convolution" in kinds and len(node.args) > 6 and node.args[6] is True)
        work = _numel(args[0]) if transposed else _numel(out)
        return 2 * work * math.prod(weight.shape[1:])
    if "convolution_backward" in kinds and len(args) >= 3:
        grad_out, weight = args[0], args[2]
        mask = cast(Sequence[bool], node.args[10]) if len(node.args) > 10 else (True, True, True)
        per_grad = 2 * _numel(grad_out) * math.prod(weight.shape[1:])
        return per_grad * sum(1 for m in list(mask)[:2] if m)  # the input and the weight gradient
    return max([_numel(out)] + [_numel(a) for a in args])


def graph_flops(graph: "Graph", _memo: dict["Graph", int] | None = None) -> int:
    """FLOPs of one execution of ``graph``: its ops plus each call's callee (x repeat count)."""
    memo = {} if _memo is None else _memo
    if graph in memo:
        return memo[graph]
    memo[graph] = 0  # recursion guard
    total = 0
    for node in graph.fx.nodes:
        called = callee(node)
        if called is not None:
            total += repeat_count(node) * graph_flops(called, memo)
        else:
            total += node_flops(node)
    memo[graph] = total
    return total


def format_flops(flops: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.3f} {unit}"
    return f"{flops:g} FLOP"


# -- the report -----------------------------------------------------------------------------
@dataclass
class GraphReport:
    """One graph of the program.

    Attributes:
        compiled_as: "main", "inlined" (one call site: copied into its caller),
            "outlined" (several call sites: one shared function), "loop body" (an
            ``ops.repeat`` body) or "not compiled" (no call site reaches it).
        op_counts: op-type histogram (views and calls included, tuple items not).
        code_ops: op instances that become code (views and calls excluded).
        code_bytes: code of this graph (0 when not compiled), counted once.
        call_sites: the call/repeat nodes of compiled graphs that call it.
        flops: FLOPs of one execution, callees included.
        peak_activation_bytes: its own live-activation peak (program order).
    """

    name: str
    compiled_as: str
    op_counts: Counter = field(default_factory=Counter)
    code_ops: int = 0
    code_bytes: int = 0
    call_sites: list[CallSite] = field(default_factory=list)
    flops: int = 0
    peak_activation_bytes: int = 0

    @property
    def num_ops(self) -> int:
        return sum(self.op_counts.values())

    @property
    def executions_per_step(self) -> int:
        """How many times one step runs this graph (1 for the main graph)."""
        return 1 if self.compiled_as == "main" else sum(s.count for s in self.call_sites)


@dataclass
class ProgramReport:
    """What a program compiles to and costs; ``str()`` renders it as a table."""

    program: str
    graphs: list[GraphReport]
    memory: ResourceEstimate
    flops_per_run: int
    """FLOPs of one ``Session.run`` on one replica: one run of the main program."""
    num_host_transfers: int
    replication_factor: int
    ipus: "IpuReport | None" = None
    """Per-IPU memory, FLOPs, copies and pipeline schedule (programs on several IPUs)."""
    remote_per_run: RemoteTraffic = field(default_factory=RemoteTraffic)
    """Streaming Memory traffic of one run (one replica)."""

    @property
    def remote_per_step(self) -> RemoteTraffic:
        """Streaming Memory traffic per step: per run / ``num_host_transfers``."""
        n, r = self.num_host_transfers, self.remote_per_run
        return RemoteTraffic(r.loaded_bytes // n, r.stored_bytes // n, r.code_bytes // n)

    @property
    def exchange_seconds_per_step(self) -> float:
        """The time one step's Streaming Memory traffic takes at the spec's bandwidth."""
        return self.remote_per_step.seconds(self.memory.spec)

    @property
    def compute_seconds_per_step(self) -> float:
        """The compute estimate of one step: its FLOPs at ``IpuSpec.flops_per_second``."""
        return self.flops_per_step / self.memory.spec.flops_per_second

    def streaming_lines(self) -> list[str]:
        """The report's Streaming Memory section (empty when the program uses none)."""
        step = self.remote_per_step
        if not (step.total_bytes or self.memory.num_remote_buffers or self.memory.code_loaded_graphs):
            return []
        spec = self.memory.spec
        return ["", "Streaming Memory per step (one replica):",
                f"  loaded remotely:  {step.loaded_bytes:>14,} B  ({mib(step.loaded_bytes)} MiB)",
                f"  stored remotely:  {step.stored_bytes:>14,} B  ({mib(step.stored_bytes)} MiB)",
                f"  code loaded:      {step.code_bytes:>14,} B  ({mib(step.code_bytes)} MiB)",
                f"  exchange time:    {self.exchange_seconds_per_step * 1e6:>14,.1f} us  (at "
                f"{spec.streaming_memory_bandwidth / 1e9:g} GB/s off-chip; on-chip SRAM: "
                f"{spec.onchip_bandwidth / 1e12:g} TB/s)",
                f"  compute estimate: {self.compute_seconds_per_step * 1e6:>14,.1f} us  "
                f"({format_flops(self.flops_per_step)} at {spec.flops_per_second / 1e12:g} TFLOP/s)",
                f"  on-chip peak:     {mib(self.memory.total_bytes):>14} MiB  (of {mib(self.memory.available_bytes)} "
                f"MiB; peak activations {mib(self.memory.activation_bytes)} MiB at {self.memory.peak_op})"]

    @property
    def flops_per_step(self) -> int:
        """FLOPs per step (one host transfer; a device-loop iteration): per run / ``num_host_transfers``."""
        return self.flops_per_run // self.num_host_transfers

    @property
    def flops_per_device_iteration(self) -> int:
        """The same as ``flops_per_step``."""
        return self.flops_per_step

    @property
    def flops_per_run_all_replicas(self) -> int:
        return self.flops_per_run * self.replication_factor

    @property
    def code_bytes(self) -> int:
        return self.memory.code_bytes

    @property
    def total_ops(self) -> int:
        return sum(g.num_ops for g in self.graphs if g.compiled_as != "not compiled")

    def graph(self, name: str) -> GraphReport:
        for g in self.graphs:
            if g.name == name:
                return g
        raise KeyError(f"no graph named {name!r} in the report: {[g.name for g in self.graphs]}")

    def __str__(self) -> str:
        lines = [f"Program report: {self.program}", ""]
        header = ("graph", "compiled as", "ops", "code ops", "code KiB", "call sites", "FLOPs/exec")
        rows = [header]
        for g in self.graphs:
            rows.append((g.name, g.compiled_as, str(g.num_ops), str(g.code_ops), f"{g.code_bytes / 1024:.1f}",
                         "-" if g.compiled_as == "main" else str(len(g.call_sites)), format_flops(g.flops)))
        compiled = [g for g in self.graphs if g.compiled_as != "not compiled"]
        rows.append(("total (compiled)", "", str(self.total_ops), str(sum(g.code_ops for g in compiled)),
                     f"{self.code_bytes / 1024:.1f}", str(sum(len(g.call_sites) for g in compiled)), ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for i, row in enumerate(rows):
            if i == len(rows) - 1:
                lines.append("  ".join("-" * w for w in widths))
            lines.append("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        lines += ["", "Call sites:"]
        called = [g for g in self.graphs if g.call_sites]
        for g in called:
            lines.append(f"  {g.name} <- {_sites_summary(g.call_sites)}")
        if not called:
            lines.append("  (none)")
        lines += ["", "Op types:"]
        for g in self.graphs:
            counts = ", ".join(f"{name} {n}" for name, n in sorted(g.op_counts.items(), key=lambda kv: (-kv[1], kv[0])))
            lines.append(f"  {g.name}: {counts or '(no ops)'}")
        lines += ["", f"Memory per IPU (one replica): {self.memory.summary()}", self.memory.breakdown()]
        n, r = self.num_host_transfers, self.replication_factor
        flop_rows = [(f"per step / device iteration (one replica, run / num_host_transfers={n})",
                      self.flops_per_step),
                     ("per Session.run (one replica)", self.flops_per_run),
                     (f"per Session.run, all replicas (x {r})", self.flops_per_run_all_replicas)]
        width = max(len(label) for label, _ in flop_rows)
        lines += ["", "FLOPs:"]
        lines += [f"  {label:<{width}}  {value:>16,}  ({format_flops(value)})" for label, value in flop_rows]
        if self.ipus is not None:
            lines += ["", str(self.ipus)]
        lines += self.streaming_lines()
        return "\n".join(lines)


def _sites_summary(sites: Sequence[CallSite], shown: int = 3) -> str:
    """``main_graph x4 (call_a, call_b, call_c, ...)`` per calling graph."""
    by_caller: dict[str, list[CallSite]] = {}
    for site in sites:
        by_caller.setdefault(site.caller, []).append(site)
    parts = []
    for caller, own in by_caller.items():
        names = [s.node + (f" (repeat x{s.count})" if s.kind == "repeat" else "") for s in own]
        more = ", ..." if len(names) > shown else ""
        parts.append(f"{caller} x{len(own)} ({', '.join(names[:shown])}{more})")
    return "; ".join(parts)


def program_report(ir: "Ir", spec: IpuSpec | None = None) -> ProgramReport:
    """The report of ``ir`` (see the module docstring); ``spec``: the IPU to compare memory with."""
    memory = estimate(ir, spec)
    sites = call_sites(ir)
    compiled = set(reachable_graphs(ir))
    memo: dict["Graph", int] = {}
    graphs = []
    for graph in ir.graphs:
        if graph is ir.main_graph:
            role = "main"
        elif graph not in compiled:
            role = "not compiled"
        elif is_inlined(graph, sites):
            role = "inlined"
        elif all(s.kind == "repeat" for s in sites[graph]) and len(sites[graph]) == 1:
            role = "loop body"
        else:
            role = "outlined"
        histogram = Counter(op_type(n) for n in graph.fx.nodes if is_op(n))
        code, code_ops, _ = graph_code_bytes(graph, sites, memory.spec) if graph in compiled else (0, 0, 0)
        graphs.append(GraphReport(
            name=graph.name, compiled_as=role, op_counts=histogram, code_ops=code_ops, code_bytes=code,
            call_sites=list(sites.get(graph, [])), flops=graph_flops(graph, memo),
            peak_activation_bytes=live_profile(graph).peak_bytes))
    report = ProgramReport(program=repr(ir), graphs=graphs, memory=memory,
                           flops_per_run=graph_flops(ir.main_graph, memo),
                           num_host_transfers=ir.num_host_transfers, replication_factor=ir.replication_factor,
                           remote_per_run=remote_traffic(ir, memory.spec))
    from ipuxl.device.ipus import ipu_report, num_ipus  # ipus builds on this module: bind late

    if num_ipus(ir) > 1:
        report.ipus = ipu_report(ir, spec)
    return report
