"""The IPU resource model of the ``"ipu_model"`` device: does a program fit on one IPU?

An IPU (Mk2 GC200) has 1472 tiles with 624 KiB of SRAM each (~897 MiB) and no other
memory: variables, the compiled program itself and the live activations all share
it. ``estimate(ir)`` adds up, **per IPU** (one replica: an ``Ir(replication=R)``
runs R copies of the program, one per IPU, so every number here is one replica's):

* **variables** and **constants**: always live (``get_attr`` tensors of every
  compiled graph; a constant of an outlined graph exists once);
* **code**: op instances in the compiled program times ``IpuSpec.code_bytes_per_op``.
  The main graph and every *distinct* graph it reaches count once: a graph called
  from several sites is one shared (outlined) function, a graph with one call site
  is inlined by the device, once. Each call of an outlined graph and each
  ``ops.repeat`` loop adds ``code_bytes_per_call_site`` (a few control
  instructions). Views (reshape, transpose, slices...) and tuple items are tensor
  re-indexing in Poplar, not code: they count 0;
* **peak activations**: the peak of ``passes.liveness.live_profile`` of the main graph
  in the memory-aware schedule (``passes.schedule.memory_schedule``, never worse
  than program order); a call adds its callee's own peak while it runs;
* **stream buffers**: one slot per host stream the program loads or stores, in
  any graph. The host feeds/collects one slice per transfer, so neither
  ``num_host_transfers`` nor the number of loads of a stream multiplies them.

``Session(ir, "ipu_model")`` raises ``OutOfMemoryError`` with this breakdown when the
total exceeds ``IpuSpec.memory_bytes``; ``"cpu"`` and ``"ipu_hw"`` have no limit.

**Streaming Memory** (off-chip, per replica; ``ipuxl.ir.remote``) is accounted
separately from on-chip memory, against ``IpuSpec.streaming_memory_bytes``: every
remote buffer (``entries`` x slot bytes; remote variables live in them) and the code of
graphs loaded with ``ops.remote_code_load``. Such a graph's code counts on-chip only
while loaded: the code-loaded graphs share one on-chip region, the size of the largest
(its code is in ``code``; the rest of their code is off-chip). Tensors loaded with
``ops.remote_load`` are activations: on-chip only while live, so the peak activations
of a phased program are those of its largest phase. ``remote_traffic(ir)`` counts the
bytes moved per run (``ProgramReport`` shows them per step with the time they take at
``IpuSpec.streaming_memory_bandwidth`` next to the compute estimate).

**Tensor locations** (PopTorch's ``Options.TensorLocations``; ``tensor_locations(ir)``): a
variable recorded off-chip (``StoredTensor(offchip=True)``) is accounted in Streaming
Memory instead of on-chip (values and program unchanged: the simulation keeps it where
it was and only accounts it off-chip), and each step loads it once and, when the program
updates it, stores it once (``remote_traffic``). With replicated tensor sharding
(``shards`` > 1) each replica holds ``ceil(bytes / shards)`` of it, on-chip or off-chip.

Which spec is used: the ``spec=`` argument when given, else ``DEFAULT_SPEC``
(reassign it or call ``set_default_spec``) with the fields named by environment
variables replaced: ``IPUXL_IPU_MEMORY_MIB`` (total memory per IPU, MiB),
``IPUXL_IPU_TILES``, ``IPUXL_IPU_BYTES_PER_TILE``, ``IPUXL_IPU_CODE_BYTES_PER_OP``,
``IPUXL_IPU_CODE_BYTES_PER_CALL_SITE``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch.fx as fx

from ipuxl.errors import InvalidArgumentError, OutOfMemoryError
from ipuxl.ir.aliases import is_view
from ipuxl.ir.calls import (
    call_nodes, callee, callee_of, is_call, is_repeat, reachable_graphs, repeat_count, transfer_counts,
)
from ipuxl.ir.meta import NAME, OP, REMOTE, ROLE, Role
from ipuxl.ir.remote import RemoteBuffer, code_loaded_graphs, remote_buffers
from ipuxl.passes.liveness import LiveProfile, live_profile, tensor_bytes

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir

__all__ = [
    "IpuSpec", "DEFAULT_SPEC", "ResourceEstimate", "CallSite", "estimate", "check_fits", "get_spec",
    "set_default_spec", "use_spec", "call_sites", "code_nodes", "op_type", "mib", "RemoteTraffic", "remote_traffic",
    "StoredTensor", "tensor_locations", "held_bytes", "describe_node", "is_inlined", "graph_code_bytes", "is_op"]

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True)
class IpuSpec:
    """Memory of one IPU and the cost of compiled code.

    Attributes:
        tiles: tiles per IPU (1472 on a Mk2 GC200).
        bytes_per_tile: SRAM per tile (624 KiB on a Mk2), so ~897 MiB per IPU.
        code_bytes_per_op: bytes of compiled code per op instance, 8 KiB by default.
            Poplar compiles each op into compute sets spread over the tiles: per tile
            it touches, control code, exchange code and vertex state take tens of
            bytes. 8 KiB is ~5.6 B on each of the 1472 tiles, the average of small
            elementwise ops (a few tiles, a few hundred bytes) and large matmuls
            (all tiles, tens of KiB). With it, 10k op instances of an unrolled model
            take ~78 MiB and ~115k fill the whole IPU, the order of magnitude at which
            large inlined models ran out of memory from code alone, which is why
            PopXL programs outline repeated layers.
        code_bytes_per_call_site: bytes per call of an outlined graph or ``repeat``
            loop: a call is a few control instructions (256 B by default).
        memory_bytes_override: total memory per IPU, replacing
            ``tiles * bytes_per_tile`` (set by ``IPUXL_IPU_MEMORY_MIB``).
        streaming_memory_bytes: Streaming Memory (off-chip DRAM) per replica: 64 GiB by
            default, an IPU-M2000's 256 GiB shared by its 4 IPUs.
        streaming_memory_bandwidth: bytes per second between Streaming Memory and one
            IPU: 20 GB/s by default (the order of an M2000's DDR4 bandwidth per IPU).
        onchip_bandwidth: bytes per second of one IPU's SRAM, all tiles together (47.5 TB/s
            on a Mk2), for comparison with the off-chip bandwidth.
        flops_per_second: the compute estimate's rate: 62.5 TFLOP/s, a Mk2's float32 peak.
    """

    tiles: int = 1472
    bytes_per_tile: int = 624 * KiB
    code_bytes_per_op: int = 8 * KiB
    code_bytes_per_call_site: int = 256
    memory_bytes_override: int | None = None
    streaming_memory_bytes: int = 64 * 1024 * MiB
    streaming_memory_bandwidth: float = 20e9
    onchip_bandwidth: float = 47.5e12
    flops_per_second: float = 62.5e12

    def __post_init__(self) -> None:
        for name in ("tiles", "bytes_per_tile", "code_bytes_per_op", "code_bytes_per_call_site"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"IpuSpec.{name} must be an int >= 0, got {value!r}",
                                           fix="e.g. IpuSpec(tiles=1472, bytes_per_tile=624 * 1024)")
        for name in ("streaming_memory_bytes", "streaming_memory_bandwidth", "onchip_bandwidth", "flops_per_second"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"IpuSpec.{name} must be a number > 0, got {value!r}",
                                           fix="e.g. IpuSpec(streaming_memory_bandwidth=20e9)")

    @property
    def memory_bytes(self) -> int:
        """Memory of one IPU: everything a replica holds must fit in it."""
        if self.memory_bytes_override is not None:
            return self.memory_bytes_override
        return self.tiles * self.bytes_per_tile

    def describe(self) -> str:
        if self.memory_bytes_override is not None:
            return "set by IPUXL_IPU_MEMORY_MIB" if os.environ.get("IPUXL_IPU_MEMORY_MIB") else "memory_bytes_override"
        return f"{self.tiles} tiles x {self.bytes_per_tile / KiB:g} KiB"


DEFAULT_SPEC = IpuSpec()

_ENV = {
    "IPUXL_IPU_TILES": "tiles",
    "IPUXL_IPU_BYTES_PER_TILE": "bytes_per_tile",
    "IPUXL_IPU_CODE_BYTES_PER_OP": "code_bytes_per_op",
    "IPUXL_IPU_CODE_BYTES_PER_CALL_SITE": "code_bytes_per_call_site",
}


def get_spec(spec: IpuSpec | None = None) -> IpuSpec:
    """``spec`` if given, else ``DEFAULT_SPEC`` with the environment's overrides."""
    if spec is not None:
        if not isinstance(spec, IpuSpec):
            raise InvalidArgumentError(f"spec must be an IpuSpec, got {spec!r}", fix="pass ipuxl.device.resources.IpuSpec(...)")
        return spec
    changes: dict[str, int] = {}
    for var, name in _ENV.items():
        if os.environ.get(var):
            changes[name] = int(_env_number(var, int))
    if os.environ.get("IPUXL_IPU_MEMORY_MIB"):
        changes["memory_bytes_override"] = int(_env_number("IPUXL_IPU_MEMORY_MIB", float) * MiB)
    return dataclasses.replace(DEFAULT_SPEC, **changes) if changes else DEFAULT_SPEC


def _env_number(var: str, kind: type) -> int | float:
    text = os.environ[var]
    try:
        value = kind(text)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgumentError(f"environment variable {var}={text!r} is not a number >= 0",
                                   fix=f"set {var} to e.g. 900, or unset it")
    return value


def set_default_spec(spec: IpuSpec) -> IpuSpec:
    """Make ``spec`` the default of every later estimate and ``"ipu_model"`` session;
    returns the previous default (to restore it)."""
    global DEFAULT_SPEC
    if not isinstance(spec, IpuSpec):
        raise InvalidArgumentError(f"set_default_spec needs an IpuSpec, got {spec!r}", fix="pass IpuSpec(...)")
    previous, DEFAULT_SPEC = DEFAULT_SPEC, spec
    return previous


@contextlib.contextmanager
def use_spec(spec: IpuSpec) -> Iterator[IpuSpec]:
    """``with use_spec(IpuSpec(tiles=4)):`` the default spec inside the block."""
    previous = set_default_spec(spec)
    try:
        yield spec
    finally:
        set_default_spec(previous)


def mib(n: int | float) -> str:
    """Bytes as MiB with one decimal."""
    return f"{n / MiB:.1f}"


# -- the program's structure -----------------------------------------------------------
@dataclass(frozen=True)
class CallSite:
    """One call/repeat node: ``caller`` graph, node name, ``count`` iterations (1 for a call)."""

    caller: str
    node: str
    kind: str  # "call" or "repeat"
    count: int = 1

    def __str__(self) -> str:
        return f"{self.caller}:{self.node}" + (f" (repeat x{self.count})" if self.kind == "repeat" else "")


def call_sites(ir: "Ir") -> dict["Graph", list[CallSite]]:
    """For each graph of the IR, the call/repeat nodes of compiled graphs that call it."""
    sites: dict[Graph, list[CallSite]] = {g: [] for g in ir.graphs}
    for graph in reachable_graphs(ir):
        for node in call_nodes(graph):
            site = CallSite(graph.name, node.name, "repeat" if is_repeat(node) else "call", repeat_count(node))
            sites.setdefault(callee_of(node), []).append(site)
    return sites


def is_inlined(graph: "Graph", sites: dict["Graph", list[CallSite]]) -> bool:
    """The device copies a graph with one call site (a plain call, not a loop) into its caller."""
    own = sites.get(graph, [])
    return len(own) == 1 and own[0].kind == "call"


def is_op(node: fx.Node) -> bool:
    """An op instance of the program: a call_function that is not a tuple item, or a host load."""
    if node.op == "placeholder":
        return node.meta.get(OP) == "host_load"
    return node.op == "call_function" and node.target is not operator.getitem


def code_nodes(graph: "Graph") -> list[fx.Node]:
    """The ops of ``graph`` that become code: ops except views and subgraph calls."""
    return [n for n in graph.fx.nodes if is_op(n) and not is_view(n) and not is_call(n)]


def op_type(node: fx.Node) -> str:
    """A readable op type: PopXL's op name when the builder recorded it, else the torch op's."""
    op = node.meta.get(OP)
    if op and op != "output_of":
        return str(op)
    target = node.target
    name = getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)
    return str(name)


# -- tensor locations ------------------------------------------------------------------
@dataclass(frozen=True)
class StoredTensor:
    """Where a variable is stored (PopTorch's ``TensorLocations``): ``kind`` ("weight",
    "optimizer", "accumulator"), ``offchip`` (Streaming Memory), ``shards`` (replicated
    tensor sharding: each replica holds 1/shards of it), ``written`` (the program updates
    it, so each step stores it back)."""

    kind: str
    offchip: bool
    shards: int = 1
    written: bool = False


def tensor_locations(ir: "Ir") -> dict[fx.Node, StoredTensor]:
    """The variables (``get_attr`` nodes) of ``ir`` with a recorded location; absent: on-chip, whole."""
    found: dict[fx.Node, StoredTensor] = ir.__dict__.setdefault("_ipuxl_tensor_locations", {})
    return found


def held_bytes(node: fx.Node, where: StoredTensor | None) -> int:
    """Bytes one replica holds of variable ``node`` stored as ``where``."""
    size = tensor_bytes(node.meta.get("val"))
    return size if where is None or where.shards <= 1 else -(-size // where.shards)


# -- the estimate ---------------------------------------------------------------------
@dataclass
class ResourceEstimate:
    """Memory of one replica (one IPU) of a program; all sizes in bytes."""

    spec: IpuSpec
    replication_factor: int
    variable_bytes: int
    num_variables: int
    constant_bytes: int
    code_bytes: int
    code_ops: int
    outlined_call_sites: int
    activation_bytes: int
    peak_op: str
    stream_bytes: int
    num_streams: int
    code_bytes_by_graph: dict[str, int] = field(default_factory=dict)
    schedule: str = "program order"
    remote_buffer_bytes: int = 0
    """Streaming Memory of the remote buffers (remote variables included), per replica."""
    num_remote_buffers: int = 0
    remote_code_bytes: int = 0
    """Code of the code-loaded graphs, kept in Streaming Memory."""
    code_loaded_graphs: int = 0
    loaded_code_bytes: int = 0
    """The on-chip region code-loaded graphs run from (the largest of them; part of ``code_bytes``)."""
    offchip_variable_bytes: int = 0
    """Variables stored off-chip by their tensor location (``tensor_locations``), per replica."""
    num_offchip_variables: int = 0

    @property
    def total_bytes(self) -> int:
        """On-chip bytes of one replica."""
        return self.variable_bytes + self.constant_bytes + self.code_bytes + self.activation_bytes + self.stream_bytes

    @property
    def streaming_memory_bytes(self) -> int:
        """Streaming Memory (off-chip) bytes of one replica."""
        return self.remote_buffer_bytes + self.remote_code_bytes + self.offchip_variable_bytes

    @property
    def available_bytes(self) -> int:
        return self.spec.memory_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.available_bytes and self.streaming_fits

    @property
    def streaming_fits(self) -> bool:
        return self.streaming_memory_bytes <= self.spec.streaming_memory_bytes

    def streaming_line(self) -> str | None:
        """The Streaming Memory row of the breakdown (None when the program uses none)."""
        if not (self.num_remote_buffers or self.code_loaded_graphs or self.num_offchip_variables):
            return None
        code = (f", code of {self.code_loaded_graphs} code-loaded graph{'s' * (self.code_loaded_graphs != 1)} "
                f"{mib(self.remote_code_bytes)} MiB (on-chip while loaded: {mib(self.loaded_code_bytes)} MiB)"
                if self.code_loaded_graphs else "")
        offchip = (f", {self.num_offchip_variables} variable{'s' * (self.num_offchip_variables != 1)} stored off-chip "
                   f"(tensor locations) {mib(self.offchip_variable_bytes)} MiB" if self.num_offchip_variables else "")
        return (f"  {'Streaming Memory:':<18} {mib(self.streaming_memory_bytes)} MiB  (off-chip, per replica, of "
                f"{mib(self.spec.streaming_memory_bytes)} MiB: {self.num_remote_buffers} remote "
                f"buffer{'s' * (self.num_remote_buffers != 1)} {mib(self.remote_buffer_bytes)} MiB{code}{offchip})")

    def components(self) -> list[tuple[str, int, str]]:
        """(name, bytes, detail) per part of the total."""
        s = self.spec
        calls = f" + {self.outlined_call_sites} call sites x {s.code_bytes_per_call_site} B" if self.outlined_call_sites else ""
        return [
            ("variables", self.variable_bytes, f"{self.num_variables} tensor{'s' * (self.num_variables != 1)}, always live, per replica"),
            ("constants", self.constant_bytes, "always live"),
            ("code", self.code_bytes, f"{self.code_ops} op instances x {s.code_bytes_per_op / KiB:g} KiB{calls}"),
            ("peak activations", self.activation_bytes, f"at {self.peak_op}, {self.schedule}"),
            ("stream buffers", self.stream_bytes, f"{self.num_streams} streams, one slot each"),
        ]

    def breakdown(self) -> str:
        """The aligned table of the parts, in MiB with one decimal."""
        rows = [(name, mib(size), detail) for name, size, detail in self.components()]
        rows.append(("total", mib(self.total_bytes), f"of {mib(self.available_bytes)} MiB available per IPU"))
        width = max(len(r[1]) for r in rows)
        lines = [f"  {name + ':':<18} {size:>{width}} MiB  ({detail})" for name, size, detail in rows]
        streaming = self.streaming_line()
        return "\n".join(lines + ([streaming] if streaming else []))

    def suggestions(self) -> list[str]:
        """What would make the program fit, most useful (largest part) first; parts under
        10% of the total are left out (the largest part is always there)."""
        advice = {
            "code": "outline repeated blocks so their code exists once: build a block as one subgraph and call it "
                    "from every site (ir.create_graph + ops.call, or ops.repeat), or run ipuxl.passes.outline on "
                    f"a traced model ({self.code_ops} op instances are compiled now)",
            "peak activations": "reduce live activations: recompute activations in the backward pass instead of "
                                "keeping them, or use a smaller micro-batch (gradient accumulation keeps the batch)",
            "variables": "spread the variables: more replicas with replicated tensor sharding of the optimiser "
                         "state, sharding the model over several IPUs, or a smaller dtype (float16/bfloat16)",
            "stream buffers": "use smaller host transfers (a smaller micro-batch per step)",
            "constants": "make large constants variables or compute them on the device",
        }
        parts = sorted(((size, name) for name, size, _ in self.components() if size and name in advice), reverse=True)
        return [advice[name] for i, (size, name) in enumerate(parts) if i == 0 or size >= 0.1 * self.total_bytes]

    def summary(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"{mib(self.total_bytes)} MiB of {mib(self.available_bytes)} MiB per IPU ({verdict}; "
                f"replication factor {self.replication_factor}: one replica per IPU)")

    def check(self, where: str | None = None) -> None:
        """Raise ``OutOfMemoryError`` (breakdown + what would help) unless the program fits."""
        if self.fits:
            return
        if not self.streaming_fits:
            raise OutOfMemoryError(
                f"the program's Streaming Memory does not fit: it needs {mib(self.streaming_memory_bytes)} MiB per "
                f"replica off-chip, the spec has {mib(self.spec.streaming_memory_bytes)} MiB\n{self.breakdown()}",
                where=where, fix="shard remote variables over more replicas (replica_sharded_buffer), use fewer "
                                 "buffer entries, or raise IpuSpec.streaming_memory_bytes")
        over = self.total_bytes - self.available_bytes
        what = (f"the program does not fit in the memory of one IPU: it needs {mib(self.total_bytes)} MiB per "
                f"replica, the IPU has {mib(self.available_bytes)} MiB ({self.spec.describe()}), "
                f"{mib(over)} MiB too much\n{self.breakdown()}")
        numbered = "; ".join(f"({i}) {s}" for i, s in enumerate(self.suggestions(), 1))
        raise OutOfMemoryError(what, where=where,
                               fix=f"{numbered}. Or run with device 'cpu' (no memory limit), or configure "
                                   "ipuxl.device.resources.DEFAULT_SPEC / IPUXL_IPU_MEMORY_MIB")


def _schedule(graph: "Graph") -> tuple[list[fx.Node] | None, str]:
    from ipuxl.passes.schedule import memory_schedule

    return list(memory_schedule(graph)), "memory schedule"


def activation_profile(ir: "Ir") -> tuple[LiveProfile, str]:
    """Live activation bytes of the main graph in the schedule the estimate uses."""
    order, schedule = _schedule(ir.main_graph)
    return live_profile(ir.main_graph, order), schedule


def describe_node(node: fx.Node | None) -> str:
    if node is None:
        return "no op"
    called = callee(node)
    if called is not None:
        return f"the call of '{called.name}' ('{node.name}')"
    return f"op '{node.meta.get(NAME, node.name)}' ({op_type(node)})"


def graph_code_bytes(graph: "Graph", sites: dict["Graph", list[CallSite]], spec: IpuSpec) -> tuple[int, int, int]:
    """(code bytes, code op instances, outlined call sites) of one compiled graph."""
    ops = len(code_nodes(graph))
    calls = sum(1 for n in call_nodes(graph) if not is_inlined(callee_of(n), sites))
    return ops * spec.code_bytes_per_op + calls * spec.code_bytes_per_call_site, ops, calls


def estimate(ir: "Ir", spec: IpuSpec | None = None) -> ResourceEstimate:
    """Per-IPU memory of ``ir`` (see the module docstring for what counts)."""
    spec = get_spec(spec)
    graphs = reachable_graphs(ir)
    sites = call_sites(ir)
    variables = constants = num_variables = 0
    code = code_ops = outlined = 0
    by_graph: dict[str, int] = {}
    loaded = code_loaded_graphs(ir)
    remote_code = region = 0
    locations = tensor_locations(ir)
    offchip = num_offchip = 0
    for graph in graphs:
        for node in graph.fx.nodes:
            if node.op == "get_attr":
                where = locations.get(node)
                size = held_bytes(node, where)
                if where is not None and where.offchip:
                    offchip, num_offchip = offchip + size, num_offchip + 1
                elif node.meta.get(ROLE) == Role.VARIABLE:
                    variables += size
                    num_variables += 1
                else:
                    constants += size
        g_code, g_ops, g_calls = graph_code_bytes(graph, sites, spec)
        by_graph[graph.name] = g_code
        if graph in loaded:  # off-chip, on-chip only while loaded (the module docstring)
            remote_code, region = remote_code + g_code, max(region, g_code)
            g_code = 0
        code, code_ops, outlined = code + g_code, code_ops + g_ops, outlined + g_calls
    code += region
    buffers = remote_buffers(ir)
    profile, schedule = activation_profile(ir)
    streams = list(transfer_counts(ir.main_graph))
    return ResourceEstimate(
        spec=spec, replication_factor=ir.replication_factor, variable_bytes=variables, num_variables=num_variables,
        constant_bytes=constants, code_bytes=code, code_ops=code_ops, outlined_call_sites=outlined,
        activation_bytes=profile.peak_bytes, peak_op=describe_node(profile.peak_at), stream_bytes=sum(tensor_bytes(s.spec.to_meta()) for s in streams),
        num_streams=len(streams), code_bytes_by_graph=by_graph, schedule=schedule,
        remote_buffer_bytes=sum(b.nbytes for b in buffers), num_remote_buffers=len(buffers),
        remote_code_bytes=remote_code, code_loaded_graphs=sum(1 for g in loaded if g in graphs),
        loaded_code_bytes=region, offchip_variable_bytes=offchip, num_offchip_variables=num_offchip)


@dataclass(frozen=True)
class RemoteTraffic:
    """Bytes one run of the main program moves between Streaming Memory and the chip (one replica)."""

    loaded_bytes: int = 0
    """``remote_load``/``remote_load_`` data, executed count (calls and repeat counts included),
    plus each off-chip variable (``tensor_locations``) once per step."""
    stored_bytes: int = 0
    """``remote_store`` data, plus each off-chip variable the program updates once per step."""
    code_bytes: int = 0
    """Code brought on-chip by ``remote_code_load``."""

    @property
    def total_bytes(self) -> int:
        return self.loaded_bytes + self.stored_bytes + self.code_bytes

    def seconds(self, spec: IpuSpec) -> float:
        """The time the traffic takes at ``spec.streaming_memory_bandwidth``."""
        return self.total_bytes / spec.streaming_memory_bandwidth


def remote_traffic(ir: "Ir", spec: IpuSpec | None = None) -> RemoteTraffic:
    """The Streaming Memory traffic of one run of ``ir``'s main program (one replica)."""
    spec = get_spec(spec)
    sites = call_sites(ir)
    memo: dict["Graph", tuple[int, int, int]] = {}

    def walk(graph: "Graph") -> tuple[int, int, int]:
        if graph in memo:
            return memo[graph]
        memo[graph] = (0, 0, 0)  # recursion guard
        load = store = code = 0
        for node in graph.fx.nodes:
            called = callee(node)
            if called is not None:
                sub = walk(called)
                n = repeat_count(node)
                load, store, code = load + n * sub[0], store + n * sub[1], code + n * sub[2]
                continue
            op, target = node.meta.get(OP), node.meta.get(REMOTE)
            if isinstance(target, RemoteBuffer):
                slot = target.nbytes // target.entries
                if op in ("remote_load", "remote_load_"):
                    load += slot
                elif op == "remote_store":
                    store += slot
            elif op == "remote_code_load" and target is not None:
                code += graph_code_bytes(target, sites, spec)[0]
        memo[graph] = (load, store, code)
        return memo[graph]

    load, store, code = walk(ir.main_graph)
    for node, where in tensor_locations(ir).items():  # off-chip variables: loaded (stored) once per step
        if where.offchip and node.graph is ir.main_graph.fx:
            steps = max((repeat_count(u) if is_repeat(u) else 1 for u in node.users), default=0)
            size = held_bytes(node, where)
            load, store = load + steps * size, store + (steps * size if where.written else 0)
    return RemoteTraffic(load, store, code)


def check_fits(ir: "Ir", spec: IpuSpec | None = None, where: str | None = None) -> ResourceEstimate:
    """``estimate(ir, spec)``, raising ``OutOfMemoryError`` when it does not fit."""
    result = estimate(ir, spec)
    from ipuxl.device import ipus  # several IPUs: each has its own memory

    if ipus.num_ipus(ir) > 1:
        ipus.check_each_ipu(ir, result.spec, where or f"Session({ir!r}, 'ipu_model')")
        if not result.streaming_fits:  # Streaming Memory is per replica, whatever the IPUs
            result.check(where or f"Session({ir!r}, 'ipu_model')")
        return result
    result.check(where or f"Session({ir!r}, 'ipu_model')")
    return result
