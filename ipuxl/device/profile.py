"""Where a session's run spends its time: runs under ``torch.profiler``, every op labelled.

``Session.profile`` (and ``PoplarExecutor.profile``, which calls it) runs the program
a few times under ``torch.profiler`` (CPU activity) and returns a ``Profile``: a
table of the most expensive ops, each named by its graph, its op and the user's
source line that built it, with its share of the profiled time. It can also write
the Chrome/Perfetto trace (open it in ``chrome://tracing`` or ui.perfetto.dev).

How the ops are labelled (normal runs are untouched):

1. Each compiled graph (the main program and every compiled callee: ``ops.call``
   targets and ``ops.repeat`` bodies) is copied into a
   *labelled* fx graph: each op node sits between the opening and the closing of a
   ``torch.profiler.record_function`` region named after it, and the whole body is
   one region named ``"<graph>: (between ops)"``. The op nodes are the compiled
   ones, unchanged, so a labelled run computes exactly what a normal run does.
2. Calls and repeats in a labelled graph call the labelled copies of their callees.
3. An op inlined from a graph with a single call site keeps the IR node's metadata;
   its ``OP_ID`` (unique in the IR) gives the graph it was built in.
4. The profiled runs run the labelled programs, each run inside one
   ``"ipuxl run"`` region.

How the time is split: every profiled event's self time goes to the innermost
labelled region around it, so an op's row holds its kernels and the Python that
calls them; ``"(host)"`` is the time of a run outside the program (staging inputs,
reading outputs, a PopTorch model's batching and weight bookkeeping). The shares
add up to 100% of the runs' time. A second table splits the same time by torch
op (``aten::...``) instead.

Limits: one local replica (several run in threads that ``torch.profiler`` does
not record: refused); CPU activity only (on CUDA the table shows the time to
launch kernels, not to run them); each region costs a few microseconds, which land
in its op's row (and in ``(outside torch ops)``), so ops of a few microseconds look
more expensive than they are in a normal run.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Mapping, Sequence

import torch
import torch.fx as fx
from torch.autograd.profiler import record_function

from ipuxl.errors import InvalidValueError, UnsupportedError
from ipuxl.ir.calls import does_host_io, repeat_count, run_repeat
from ipuxl.ir.graph import identifier
from ipuxl.ir.lower import compiled_callee
from ipuxl.ir.meta import CALLED_GRAPH, NAME, OP, OP_ID, SOURCE

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir

__all__ = ["Profile", "ProfileRow", "labelled_programs", "profile_runs", "RUN", "HOST", "OUTSIDE"]

#: The region around each profiled run.
RUN = "ipuxl run"
#: The row of a run's time outside the compiled program.
HOST = "(host)"
#: The row (by torch op) of the time outside torch ops: Python, the runtime, the profiler.
OUTSIDE = "(outside torch ops)"
_BETWEEN = "(between ops)"


# -- 1. labelled copies of the compiled programs ----------------------------------------------
def _open(label: str) -> record_function:
    region = record_function(label)
    region.__enter__()
    return region


def _close(region: record_function) -> None:
    region.__exit__(None, None, None)


@dataclass
class _Labeller:
    """Labels of the nodes of one IR's compiled graphs, and their labelled copies."""

    ir: "Ir"
    compiled: Callable[["Graph"], Any]
    ir_nodes: dict[int, tuple["Graph", fx.Node]] = field(default_factory=dict)
    callees: dict["Graph", Callable[..., tuple]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for graph in self.ir.graphs:
            for node in graph.fx.nodes:
                if OP_ID in node.meta:
                    self.ir_nodes[node.meta[OP_ID]] = (graph, node)

    def label(self, node: fx.Node, graph: "Graph") -> str | None:
        """``"graph: op [name] file.py:12 in fn"``; None for nodes not worth a region."""
        if node.op not in ("call_function", "call_method") or node.target is operator.getitem:
            return None
        built_in = self.ir_nodes.get(node.meta.get(OP_ID, -1), (graph, None))[0]
        op = node.meta.get(OP) or _target_name(node.target)
        name = node.meta.get(NAME)
        if CALLED_GRAPH in node.meta:  # its name is the callee's: say it once
            op, name = f"{op} {node.meta[CALLED_GRAPH].name}", None
        text = f"{built_in.name}: {op}"
        if name and not str(name).startswith(op):
            text += f" [{name}]"
        source = node.meta.get(SOURCE)
        return f"{text} {_short_source(source)}" if source else text

    def module(self, module: fx.GraphModule, graph: "Graph") -> fx.GraphModule:
        """A copy of ``module`` (the compiled ``graph``) with every op in its own region."""
        new = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        body: fx.Node | None = None
        for node in module.graph.nodes:
            if node.op == "output":
                if body is not None:
                    new.call_function(_close, (body,))
                new.output(fx.map_arg(node.args[0], env.__getitem__))
                continue
            if node.op != "placeholder" and body is None:
                body = new.call_function(_open, (f"{graph.name}: {_BETWEEN}",))
            label = self.label(node, graph)
            region = new.call_function(_open, (label,)) if label else None
            # a plain fx copy of compiled code (not an IR graph): its alias records name IR
            # nodes, as lowering left them (see ir.lower), not nodes of this code
            env[node] = new.node_copy(node, env.__getitem__)
            if CALLED_GRAPH in node.meta:
                env[node].target = self.callee(node)
            if region is not None:
                new.call_function(_close, (region,))
        return fx.GraphModule(module, new, class_name=identifier(f"ipuxl_labelled_{graph.name}"))

    def callee(self, node: fx.Node) -> Callable[..., tuple]:
        """The labelled code a call or repeat node of a compiled graph runs instead."""
        called: "Graph" = node.meta[CALLED_GRAPH]
        if called not in self.callees:
            compiled = self.compiled(called)
            assert compiled is not None, "a graph called from compiled code is compiled"
            self.callees[called] = self.module(compiled.module, called).forward
        body = self.callees[called]
        if node.meta.get(OP) != "repeat":
            return compiled_callee(called, body)
        count = repeat_count(self.ir_nodes[node.meta[OP_ID]][1])
        return _repeat(body, count, len(called.outputs), does_host_io(called), identifier(f"repeat_{called.name}"))


def _repeat(body: Callable[..., tuple], count: int, n_carried: int, with_io: bool,
            name: str) -> Callable[..., tuple]:
    """``ops.repeat`` of ``body`` (as the lowering's), named ``name`` for fx's codegen."""
    def repeat(*args: Any) -> tuple:
        if with_io:
            return run_repeat(body, count, n_carried, args[1:], args[0])
        return run_repeat(body, count, n_carried, args)

    repeat.__name__ = repeat.__qualname__ = name
    repeat.__module__ = "ipuxl.compiled"
    return repeat


def _target_name(target: Any) -> str:
    name = getattr(target, "__name__", None) or str(target)
    return name.split(".")[0]  # aten overloads: "convolution.default" -> "convolution"


def _short_source(source: str) -> str:
    """``"/path/to/file.py:12 in fn"`` -> ``"file.py:12 in fn"``."""
    where, sep, function = source.partition(" in ")
    return os.path.basename(where) + sep + function


def labelled_programs(ir: "Ir", programs: Sequence[fx.GraphModule],
                      compiled: Callable[["Graph"], Any]) -> list[Callable[..., Any]]:
    """The ``forward`` of a labelled copy of each main program (see the module docstring).

    Args:
        ir: the IR the programs were compiled from.
        programs: the compiled main program of each local replica (``Session.programs``).
        compiled: ``Session.compiled_graph``: the compiled code of a called graph.

    Raises:
        UnsupportedError: more than one program (replicas run in threads the profiler does not see).
    """
    if len(programs) > 1:
        raise UnsupportedError(
            f"profile: the program runs {len(programs)} replicas in this process, each in a thread of its own, "
            "and torch.profiler records only the thread that profiles", where=f"Session of {ir!r}",
            fix="profile the program with one replica (replicationFactor/replication 1): each replica runs the "
                "same code")
    labeller = _Labeller(ir, compiled)
    return [labeller.module(program, ir.main_graph).forward for program in programs]


# -- 2. the profiled runs ---------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileRow:
    """One row of a ``Profile``: a labelled op (or an ``aten`` op) and its time."""

    name: str
    """The label (``"graph: op [name] file.py:12 in fn"``), or the torch op's name."""
    self_us: float
    """Time in it, in microseconds over all profiled runs (nested labelled regions excluded)."""
    calls: int
    """How many times it ran in the profiled runs."""
    share: float
    """``self_us`` as a fraction of the profiled runs' time."""


@dataclass(frozen=True)
class Profile:
    """The result of ``Session.profile``: ``print`` it for the table.

    ``ops`` splits the runs' time by labelled op (most expensive first), ``aten_ops``
    by torch op; the shares of each add up to 1.
    """

    runs: int
    total_us: float
    ops: list[ProfileRow]
    aten_ops: list[ProfileRow]
    top: int = 20
    trace_path: str | None = None

    def table(self, top: int | None = None, by: Literal["op", "aten"] = "op") -> str:
        """The ``top`` (default: ``self.top``) most expensive rows, by labelled ``"op"``
        or by ``"aten"`` op."""
        if by not in ("op", "aten"):
            raise InvalidValueError(f"Profile.table: by must be 'op' or 'aten', got {by!r}",
                                    fix="pass by='op' (labelled ops) or by='aten' (torch ops)")
        rows = (self.ops if by == "op" else self.aten_ops)[:self.top if top is None else top]
        per_run = self.total_us / self.runs / 1e3
        kind = "labelled" if by == "op" else "aten"
        head = f"{self.runs} profiled run(s), {per_run:.3f} ms per run; time by {kind} op, summed over the runs"
        lines = [head, f"{'self ms':>10} {'share':>7} {'calls':>7}  {'op' if by == 'op' else 'aten op'}"]
        lines += [f"{r.self_us / 1e3:10.3f} {r.share:7.1%} {r.calls or '-':>7}  {r.name}" for r in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"{self.table()}\n\n{self.table(by='aten')}"


def profile_runs(run: Callable[[], object], *, runs: int, warmup: int, top: int,
                 trace_path: str | os.PathLike[str] | None) -> Profile:
    """Call ``run`` ``warmup`` times, then ``runs`` times under ``torch.profiler``."""
    _check_count("runs", runs, 1)
    _check_count("warmup", warmup, 0)
    _check_count("top", top, 1)
    for _ in range(warmup):
        run()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(runs):
            with record_function(RUN):
                run()
    path = None
    if trace_path is not None:
        path = os.fspath(trace_path)
        prof.export_chrome_trace(path)
    total, ops, aten = _split_time(prof.events())
    return Profile(runs, total, _rows(ops, total), _rows(aten, total), top, path)


def _check_count(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise InvalidValueError(f"profile: {name} must be an int >= {least}, got {value!r}",
                                fix=f"pass {name}={max(least, 1)} or more")


def _split_time(events: Iterable[Any]) -> tuple[float, dict[str, list[float]], dict[str, list[float]]]:
    """Total time of the runs, and per label / per torch op: ``[self time, calls]``."""
    by_label: dict[str, list[float]] = {}
    by_op: dict[str, list[float]] = {}
    todo: list[tuple[Any, str]] = [(e, HOST) for e in events if e.cpu_parent is None and e.name == RUN]
    total = sum(e.cpu_time_total for e, _ in todo)
    while todo:
        event, owner = todo.pop()
        if event.name == RUN:
            _add(by_label, HOST, 0.0, 1)
        elif event.is_user_annotation:
            owner = event.name
            _add(by_label, owner, 0.0, 1)
        _add(by_label, owner, event.self_cpu_time_total, 0)
        _add(by_op, OUTSIDE if event.is_user_annotation else event.name, event.self_cpu_time_total,
             0 if event.is_user_annotation else 1)
        todo.extend((child, owner) for child in event.cpu_children)
    return total, by_label, by_op


def _add(table: dict[str, list[float]], key: str, time: float, calls: int) -> None:
    entry = table.setdefault(key, [0.0, 0])
    entry[0] += time
    entry[1] += calls


def _rows(table: Mapping[str, list[float]], total: float) -> list[ProfileRow]:
    rows = [ProfileRow(name, t, int(calls), t / total if total else 0.0) for name, (t, calls) in table.items()]
    return sorted(rows, key=lambda r: -r.self_us)
