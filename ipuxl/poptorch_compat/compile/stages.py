"""A captured graph cut into one subgraph per pipeline stage (``split_by_stage``).

A pipelined PopTorch program runs each stage of its forward and backward as its own
program on its IPU, one micro-batch after another (``program._build_pipelined_step``).
``split_by_stage`` cuts an IR graph whose ops carry ``ipuxl.ir.meta.PIPELINE_STAGE``
(``blocks.Placement``, ``blocks.place_gradients``) into those programs:

1. each op moves, in program order, into the subgraph of its stage (an op without a
   stage joins the latest stage it reads from, else its earliest reader's);
2. a value a stage reads from the original graph's inputs becomes an input of the
   stage's subgraph; one it reads from another (earlier) stage becomes an output of
   that stage and an input of this one;
3. each output of the original graph becomes an output of the stage that computes it
   (or stays the original input it is).

``StageSplit`` records where each subgraph input comes from and where each original
output went, so a caller wires the stage calls as it would wire one call of the
original graph. The original graph is left as it was. Steps 1 and 2 are the shared
stage splitter's (``ipuxl.passes.split_stages``); this module says how PopTorch
stages ops and names the stage graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import torch.fx as fx

from ipuxl.errors import OptionsError
from ipuxl.ir.meta import IPU, NAME, PIPELINE_STAGE
from ipuxl.passes.split_stages import StageSplitter

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["FromInput", "FromStage", "StageSplit", "split_by_stage", "Source"]


@dataclass(frozen=True)
class FromInput:
    """Input ``index`` of the original graph."""

    index: int


@dataclass(frozen=True)
class FromStage:
    """Output ``index`` of stage ``stage``'s subgraph."""

    stage: int
    index: int


Source = Union[FromInput, FromStage]


@dataclass
class StageSplit:
    """The stage subgraphs of one graph and how to wire them (see the module docstring).

    Attributes:
        graphs: the subgraph of each stage, by stage number (in stage order).
        inputs: per stage, where each input of its subgraph comes from.
        outputs: where each output of the original graph is, in order.
        ipus: the IPU of each stage's ops.
    """

    graphs: dict[int, Graph] = field(default_factory=dict)
    inputs: dict[int, list[Source]] = field(default_factory=dict)
    outputs: list[Source] = field(default_factory=list)
    ipus: dict[int, int] = field(default_factory=dict)


def split_by_stage(graph: Graph, name: str) -> StageSplit:
    """Cut ``graph`` into one subgraph per pipeline stage (see the module docstring).

    Raises:
        OptionsError: an op reads a value of a later stage (a pipeline cannot run it).
    """
    stages = _stages_of(graph)
    splitter = _Splitter(graph, stages, name)
    splitter.split(n for n in graph.fx.nodes if n in stages)
    split = StageSplit()
    for node in graph.fx.nodes:
        if node in stages and IPU in node.meta and node.op == "call_function":
            split.ipus.setdefault(stages[node], int(node.meta[IPU]))
    split.outputs = [FromInput(splitter.input_index[out.node]) if out.node in splitter.input_index
                     else FromStage(stages[out.node], splitter.export(out.node)) for out in graph.outputs]
    splitter.add_outputs()
    split.inputs = {stage: [splitter.source(node, other) for node, other in inputs]
                    for stage, inputs in splitter.inputs.items()}
    split.graphs = dict(sorted(splitter.graphs.items()))
    return split


class _Splitter(StageSplitter):
    """Stage graphs ``{name}_stage{i}``, made as their first op comes; stage inputs are
    the original graph's inputs or values of earlier stages."""

    def __init__(self, graph: Graph, stages: dict[fx.Node, int], name: str):
        super().__init__(graph, stages)
        self.name = name
        self.input_index = {t.node: i for i, t in enumerate(graph.inputs)}

    def new_graph(self, stage: int) -> Graph:
        return self.graph.ir.new_subgraph(f"{self.name}_stage{stage}")

    def refuse_later(self, stage: int, node: fx.Node, later: int) -> Exception:
        return OptionsError(
            f"pipeline stage {stage} reads '{node.meta.get(NAME, node.name)}' of the later stage {later}",
            fix="order the pipeline's stages as the model runs its blocks, or use ShardedExecution")

    def add_input(self, graph: Graph, node: fx.Node) -> fx.Node:
        assert node in self.input_index or node in self.stage_of, \
            f"{node.name}: neither an input nor an op of {self.graph.name}"
        return super().add_input(graph, node)

    def source(self, node: fx.Node, stage: int | None) -> Source:
        """Where the stage input standing for ``node`` (of ``stage``, or an input) comes from."""
        return FromInput(self.input_index[node]) if stage is None else FromStage(stage, self.exports[stage][node])


def _stages_of(graph: Graph) -> dict[fx.Node, int]:
    """The stage of each op: its ``PIPELINE_STAGE``; else the latest stage of the ops it
    reads (an element of a tuple result is where the tuple is); else the earliest stage
    that reads it; else the last stage."""
    ops = [n for n in graph.fx.nodes if n.op in ("call_function", "get_attr")]
    found = {n: int(n.meta[PIPELINE_STAGE]) for n in ops if PIPELINE_STAGE in n.meta}
    last = max(found.values(), default=0)
    for node in ops:
        sources = [found[a] for a in node.all_input_nodes if a in found]
        if node not in found and sources:
            found[node] = max(sources)
    for node in reversed(ops):
        if node not in found:
            readers = [found[u] for u in node.users if u in found]
            found[node] = min(readers) if readers else last
    return found
