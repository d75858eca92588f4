"""Compiling an IR's graphs for the device: each graph once, into fx-generated Python.

``lower_to_fx`` (``ipuxl.ir.lower``) turns a graph into an fx graph that calls real torch
functions: a graph called from many sites stays one function (compiled once, here, the
first time a caller is lowered), and a graph with a single call site, or a weight's Adam
step (``Compiler.inlines``), is inlined into its caller. The device's rewrites
(``ipuxl.device.rewrites``: dead code, fused updates, kernel choice) then run on the fx
graph, once each, in their registry's order; the memory plan (``device.memory_plan``)
puts its large results in buffers kept between steps, and only then is the Python code
generated. Which rewrites changed each graph is kept (``applied``).

A compiled program reads its variables as module attributes (one ``GraphModule`` per
replica, the same code); ``pad_matrices`` lays out some of them in padded rows
(``ipuxl.device.layout``).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, NamedTuple

import torch

from ipuxl.device.fp_checks import checks_enabled, insert_checks, strict_float8_scales
from ipuxl.device.layout import needs_padding, paddable_attrs, padded_like
from ipuxl.device.memory_plan import plan_memory
from ipuxl.device.retarget import for_device
from ipuxl.device.rewrites import apply_rewrites
from ipuxl.ir.calls import does_host_io
from ipuxl.ir.graph import Graph, identifier
from ipuxl.ir.ir import Ir
from ipuxl.ir.lower import compiled_callee, lower_to_fx
from ipuxl.ir.output_sharing import OutputSharing, call_sites
from ipuxl.ir.meta import OP
from ipuxl.ir.streams import Stream
from ipuxl.kernels.workspace import Workspace

__all__ = ["CompiledGraph", "Compiler", "replica_program"]


class CompiledGraph(NamedTuple):
    """A called graph as the session compiled it."""

    module: torch.fx.GraphModule
    """Its generated code."""
    call: Callable[..., tuple]
    """The function its call sites in the generated code call."""
    takes_io: bool = False
    """Whether it does host IO: its code then takes the run's stream cursors first."""
    rewrites: tuple[str, ...] = ()
    """The device rewrites (``ipuxl.device.rewrites``) that changed its code, in the order they ran."""


class Compiler:
    """Compiles the graphs of one IR for one torch device, each called graph once.

    Args:
        ir: the program.
        device: where the compiled modules (their variables and constants) live.
        io_index: the position of each stream's cursor in the run's cursor list.
    """

    def __init__(self, ir: Ir, device: torch.device, io_index: dict[Stream, int]):
        self.device = device
        self.compiled: dict[Graph, CompiledGraph] = {}
        """Each called graph that was not inlined everywhere, compiled."""
        self.applied: dict[Graph, tuple[str, ...]] = {}
        """Every compiled graph (the main graph included): the rewrites that changed it, in order."""
        self.workspace = Workspace()
        """The buffers of the programs' large results (``device.memory_plan``)."""
        self.planned: dict[Graph, int] = {}
        """Every compiled graph: how many of its results the memory plan put in workspace buffers."""
        self._io_index = io_index
        self.fp_checks = checks_enabled(ir)
        self._strict_scales = ir.session_options.throwIfLog2ScaleTensorNotInRange
        """Whether the compiled code checks the IPU's floating-point exceptions (``device.fp_checks``)."""
        sites = call_sites(ir.graphs)
        self._sharing = OutputSharing(sites)
        self._call_sites = Counter({g: len(s) for g, s in sites.items()})

    def compile(self, graph: Graph, attrs: dict[str, torch.Tensor] | None = None) -> torch.fx.GraphModule:
        """Lower ``graph`` (inlining graphs with one call site), run the rewrites, generate its code.

        A called graph returns its outputs that share an input's storage without a copy
        where every call site allows it (``ir.output_sharing``): a transposed weight or a
        reshaped activation saved for the backward pass, read before anything writes the
        storage again."""
        root, code = lower_to_fx(graph, self.callee, attrs, inline=self.inlines, io_index=self._io_index,
                                 sharing=self._sharing)
        for_device(code, self.device)  # traced on the host, run here (device.retarget)
        code, self.applied[graph] = apply_rewrites(code)
        strict_float8_scales(code, self._strict_scales)
        if self.fp_checks:
            insert_checks(code)
        self.planned[graph] = plan_memory(code, root, self.workspace, self.device)
        # the Python code is generated once, after the rewrites
        module = torch.fx.GraphModule(root, code, class_name=identifier(f"ipuxl.{graph.name}"))
        return module.to(self.device)

    def inlines(self, graph: Graph) -> bool:
        """Whether calls of ``graph`` are copied into their callers: a graph with one call
        site, and a weight's Adam step called from many (``is_adam_step``), so that the
        rewrites see all the weights' updates of a step together (``rewrites.adam_steps``
        fuses them)."""
        return self._call_sites[graph] == 1 or is_adam_step(graph)

    def callee(self, graph: Graph) -> Callable[..., tuple]:
        """The function a call of ``graph`` in generated code calls (``graph`` compiled on first use)."""
        if graph not in self.compiled:
            module = self.compile(graph)
            self.compiled[graph] = CompiledGraph(module, compiled_callee(graph, module.forward), does_host_io(graph),
                                                 self.applied[graph])
        return self.compiled[graph].call

    def callee_module(self, fn: Any) -> tuple[torch.fx.GraphModule, int] | None:
        """The compiled module a call in generated code runs, and its loop-carried inputs."""
        graph = getattr(fn, "ipuxl_graph", None)
        compiled = self.compiled.get(graph) if graph is not None else None
        return None if compiled is None else (compiled.module, int(getattr(fn, "ipuxl_carried", 0)))

    def pad_matrices(self, program: torch.fx.GraphModule, replica_vars: list[dict[str, torch.Tensor]],
                     bound: set[str]) -> None:
        """Keep matmul weights whose rows alias in the cache in padded rows (``device.layout``).

        Only variables the session owns (not the ``bound`` ones, given by the caller),
        used by nothing but matmuls, transposes and in-place updates, and read by no
        other module attribute. ``program`` reads ``replica_vars[0]``; each replica's
        tensor is replaced by a padded copy.
        """
        if self.device.type != "cpu":  # the cache aliasing it avoids was measured on x86 CPUs (device.layout)
            return
        device_vars = replica_vars[0]
        candidates = {attr for attr, t in device_vars.items() if attr not in bound and needs_padding(t)}
        if not candidates:
            return
        modules = [program, *(c.module for c in self.compiled.values())]
        held = [t for m in modules for name, t in m.named_buffers() if not (m is program and name in candidates)]
        candidates = {a for a in candidates if not any(t is device_vars[a] for t in held)}
        for attr in paddable_attrs(program, candidates, self.callee_module):
            for variables in replica_vars:
                variables[attr] = padded_like(variables[attr])
            setattr(program, attr, device_vars[attr])


def replica_program(program: torch.fx.GraphModule, variables: dict[str, torch.Tensor]) -> torch.fx.GraphModule:
    """The main program again, reading and updating another replica's variables."""
    module = torch.fx.GraphModule(program, program.graph, class_name=type(program).__name__)
    for attr, tensor in variables.items():
        if hasattr(module, attr):
            setattr(module, attr, tensor)
    return module


def is_adam_step(graph: Graph) -> bool:
    """A graph that returns nothing, calls no graph and computes an Adam update term: an
    optimiser step that only writes its by-reference inputs (a weight and its state),
    outlined or built once for many weights (popxl.addons' ``AdamOptimizerStep``)."""
    return (not graph.outputs and not graph.called_graphs
            and any(node.meta.get(OP) == "adam_updater" for node in graph.fx.nodes))
