"""Split stages: move a graph's ops into one new graph per pipeline stage.

Both front ends pipeline this way: PopTorch's ``Stage``/``BeginBlock`` programs
(``poptorch_compat.compile.stages``) and popxl.addons' ``pipelined_execution``
(``addons_compat.transforms.pipelining``). They differ in which ops are staged, how a
stage graph is named, which error a read of a later stage is, and how a value from
outside the stages enters a stage graph: a front end says those by subclassing
``StageSplitter``; the move itself is here.

Preconditions: the ops to move come in program order, each with its stage; an op
reads values of its own or earlier stages only (a pipeline runs stage ``s`` of a
micro-batch before stage ``s + 1``).

Algorithm (``StageSplitter.split``):

1. each op is copied, in program order, into its stage's graph (made on the stage's
   first op) with ``ir.copy.copy_node``; a ``get_attr`` takes its constant along;
2. a value the op reads, or names in an alias record, that its stage graph does not
   hold yet is looked up (``lookup``):

   * a value of a later stage is refused (``refuse_later``);
   * a value of an earlier stage becomes an output of that stage's graph (``export``)
     and an input of this one;
   * a value from outside the stages becomes an input (``add_input``), unless the
     front end binds it to something else (``read_outside``: a host store's slot
     moves with its op);
3. ``add_outputs`` makes each stage graph return what other stages (and the caller)
   read of it, in the order first asked for.

``inputs`` records what each stage input stands for, so the front end wires the
stage calls as it would wire one call of the original graph. The source graph is
left as it was: the front end erases the moved ops, or keeps them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

import torch.fx as fx

from ipuxl.ir.copy import copy_node

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["StageSplitter", "StageInput"]

#: An input of a stage graph: (the source graph's node it stands for, the stage that
#: computes it, or None when it comes from outside the stages).
StageInput = tuple[fx.Node, int | None]


class StageSplitter:
    """Moves staged ops of ``graph`` into one graph per stage (see the module docstring).

    Subclasses give ``new_graph`` and ``refuse_later``, and may override
    ``read_outside`` and ``add_input``.

    Attributes:
        graph: the source graph (not changed).
        stage_of: the stage of each op to move.
        graphs: the graph of each stage, in the order they were made.
        copies: per stage, each source node's node in the stage graph (its copy,
            or the input standing for it).
        inputs: per stage, what each input of its graph stands for (``StageInput``).
        exports: per stage, its graph's outputs: {source node: output index}.
    """

    def __init__(self, graph: "Graph", stage_of: Mapping[fx.Node, int]):
        self.graph, self.stage_of = graph, stage_of
        self.graphs: dict[int, Graph] = {}
        self.copies: dict[int, dict[fx.Node, fx.Node]] = {}
        self.inputs: dict[int, list[StageInput]] = {}
        self.exports: dict[int, dict[fx.Node, int]] = {}

    # -- what a front end says ------------------------------------------------------------
    def new_graph(self, stage: int) -> "Graph":
        """A new, empty graph for ``stage`` (called once, on the stage's first op)."""
        raise NotImplementedError

    def refuse_later(self, stage: int, node: fx.Node, later: int) -> Exception:
        """The error for an op of ``stage`` reading ``node`` of the ``later`` stage."""
        raise NotImplementedError

    def read_outside(self, graph: "Graph", node: fx.Node) -> fx.Node | None:
        """A node of stage graph ``graph`` to read for ``node`` (from outside the stages)
        that is not an input of it, or None: ``node`` becomes an input."""
        return None

    def add_input(self, graph: "Graph", node: fx.Node) -> fx.Node:
        """A new input of stage graph ``graph`` standing for source node ``node``."""
        source = self.graph.wrap(node)
        return graph.add_input(source.spec, str(source.name)).node

    # -- the move -------------------------------------------------------------------------
    def split(self, nodes: Iterable[fx.Node]) -> None:
        """Steps 1 and 2: copy each of ``nodes`` (in program order) into its stage's graph."""
        for node in nodes:
            stage = self.stage_of[node]
            target = self._stage_graph(stage)
            copied = copy_node(node, target.fx, lambda arg: self.lookup(stage, arg))
            if node.op == "get_attr":
                name = str(node.target)
                target.constant_data[name] = self.graph.constant_data[name]
            self.copies[stage][node] = copied

    def lookup(self, stage: int, node: fx.Node) -> fx.Node:
        """Step 2: the node of ``stage``'s graph that stands for source node ``node``."""
        local = self.copies[stage]
        if node in local:
            return local[node]
        graph = self.graphs[stage]
        bound = self.read_outside(graph, node) if node not in self.stage_of else None
        if bound is not None:
            local[node] = bound
            return bound
        other = self.stage_of.get(node)
        if other is not None:
            if other > stage:
                raise self.refuse_later(stage, node, other)
            self.export(node)
        local[node] = self.add_input(graph, node)
        self.inputs[stage].append((node, other))
        return local[node]

    def export(self, node: fx.Node) -> int:
        """The output index of moved op ``node`` in its stage's graph (made an output on
        first request; ``add_outputs`` adds them)."""
        exports = self.exports[self.stage_of[node]]
        return exports.setdefault(node, len(exports))

    def add_outputs(self) -> None:
        """Step 3: each stage graph returns its exports, in index order."""
        for stage, graph in self.graphs.items():
            for node in self.exports[stage]:
                graph.add_output(graph.wrap(self.copies[stage][node]))

    def _stage_graph(self, stage: int) -> "Graph":
        if stage not in self.graphs:
            self.graphs[stage] = self.new_graph(stage)
            self.copies[stage], self.inputs[stage], self.exports[stage] = {}, [], {}
        return self.graphs[stage]
