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
original graph. The original graph is left as it was.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import torch.fx as fx

from ipuxl.errors import OptionsError
from ipuxl.ir.meta import BY_REF_ARGS, IPU, MODIFIES, NAME, NEGATED, PIPELINE_STAGE, VIEW_OF, WRITES

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["FromInput", "FromStage", "StageSplit", "split_by_stage"]


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
    split = StageSplit()
    stages = _stages_of(graph)
    input_index = {t.node: i for i, t in enumerate(graph.inputs)}
    env: dict[int, dict[fx.Node, fx.Node]] = {}
    exported: dict[tuple[fx.Node, int], int] = {}  # (original node, stage) -> output index of that stage

    def stage_graph(stage: int) -> Graph:
        if stage not in split.graphs:
            split.graphs[stage] = graph.ir.new_subgraph(f"{name}_stage{stage}")
            split.inputs[stage], env[stage] = [], {}
        return split.graphs[stage]

    def export(node: fx.Node) -> FromStage:
        """``node`` (an op of its stage) as an output of its stage's subgraph."""
        owner = stages[node]
        key = (node, owner)
        if key not in exported:
            exported[key] = split.graphs[owner].add_output(split.graphs[owner].wrap(env[owner][node]))
        return FromStage(owner, exported[key])

    def lookup(stage: int, arg: fx.Node) -> fx.Node:
        local = env[stage]
        if arg in local:
            return local[arg]
        source: Source
        if arg in input_index:
            source = FromInput(input_index[arg])
        elif arg in stages:
            if stages[arg] > stage:
                raise OptionsError(
                    f"pipeline stage {stage} reads '{arg.meta.get(NAME, arg.name)}' of the later stage {stages[arg]}",
                    fix="order the pipeline's stages as the model runs its blocks, or use ShardedExecution")
            source = export(arg)
        else:
            raise AssertionError(f"{arg.name}: neither an input nor an op of {graph.name}")
        spec = graph.wrap(arg).spec
        new = split.graphs[stage].add_input(spec, str(arg.meta.get(NAME, arg.name)))
        split.inputs[stage].append(source)
        local[arg] = new.node
        return new.node

    for node in graph.fx.nodes:
        if node not in stages:
            continue
        stage = stages[node]
        target = stage_graph(stage)
        copied = target.fx.node_copy(node, lambda a: lookup(stage, a))
        for key in (MODIFIES, VIEW_OF):
            if isinstance(node.meta.get(key), fx.Node):
                copied.meta[key] = lookup(stage, node.meta[key])
        if WRITES in node.meta:
            copied.meta[WRITES] = [lookup(stage, n) for n in node.meta[WRITES]]
        if BY_REF_ARGS in node.meta:
            copied.meta[BY_REF_ARGS] = set(node.meta[BY_REF_ARGS])
        copied.meta.pop(NEGATED, None)
        if node.op == "get_attr":
            target.constant_data[str(node.target)] = graph.constant_data[str(node.target)]
        if IPU in node.meta and node.op == "call_function":
            split.ipus.setdefault(stage, int(node.meta[IPU]))
        env[stage][node] = copied
    for out in graph.outputs:
        split.outputs.append(FromInput(input_index[out.node]) if out.node in input_index else export(out.node))
    split.graphs = dict(sorted(split.graphs.items()))
    return split


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
