"""popxl.addons' ``pipelined_execution``: run the ops of a context as a pipeline.

Ops built under ``with pipelined_execution(steps) as pipeline:`` must each be in a
``with pipeline.stage(i):`` block. When the context closes, the transform

1. moves the ops of each stage out of the graph into one subgraph per stage
   (``pipeline_stage_<i>``): tensors of other stages become its inputs and the
   outputs of their stage's graph; tensors from outside the pipeline (variables,
   earlier tensors) become inputs, by reference where the stage writes them (the
   stage splitter both front ends share, ``ipuxl.passes.split_stages``);
2. calls the stage graphs in the textbook pipeline order over ``steps`` micro-batches
   (``ipuxl.device.pipeline.pipeline_schedule``: ramp-up, steady state, ramp-down),
   each call on its stage's IPU and recorded with its stage
   (``ipuxl.ir.meta.PIPELINE_STAGE``), so ``session.report()`` shows the schedule.

Each stage sees the micro-batches in order and reads the other stages' results of the
same micro-batch, so results equal running the ``steps`` micro-batches one after
another without pipelining (gradient accumulation over ``steps``).

Differences from upstream: the schedule is unrolled into the graph (one call per
stage and micro-batch, the stage's code once) instead of a loop over the steady
state; a value a later stage reads is kept per micro-batch, so
``stash_and_restore_activations``/``stash_and_restore_tensor`` return the tensors they
are given (the stash is the in-flight values the memory model counts), and a later
stage reading an earlier stage's tensor without a stash gets the right value where
upstream would read a newer micro-batch's.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import TYPE_CHECKING, Iterator

import torch.fx as fx

from ipuxl.device.pipeline import pipeline_schedule
from ipuxl.errors import GraphContextError, InvalidValueError
from ipuxl.ir import context, placement
from ipuxl.ir.aliases import is_written
from ipuxl.ir.context import in_sequence
from ipuxl.ir.graph import Graph
from ipuxl.ir.meta import BY_REF, IPU, NAME, OP, PIPELINE_STAGE, ROLE, STREAM, Role
from ipuxl.ir.tensor import Tensor
from ipuxl.ops.call import CallSiteInfo, call_with_info
from ipuxl.passes.split_stages import StageSplitter

if TYPE_CHECKING:
    from ipuxl.ir.grad_info import GradGraphInfo

__all__ = ["pipelined_execution", "PipelineContext"]


class PipelineContext:
    """What ``pipelined_execution`` yields: ``stage(i)`` contexts and the stash helpers."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._stage: int | None = None
        self.ops: dict[int, list[fx.Node]] = {}

    def hook(self, node: fx.Node) -> None:
        """Record an op built in the pipeline's graph in the open stage."""
        if self._stage is None:
            raise GraphContextError(
                f"Operation must be created in a stage context: op '{node.meta.get(OP, node.name)}' was built "
                "inside pipelined_execution but outside every pipeline.stage(i)",
                where=context.user_source_line(),
                fix="build it under `with pipeline.stage(i):`, or before/after the pipelined_execution context")
        node.meta[PIPELINE_STAGE] = self._stage
        self.ops.setdefault(self._stage, []).append(node)

    @contextlib.contextmanager
    def stage(self, i: int) -> Iterator[None]:
        """Put the ops built in this context in pipeline stage ``i``."""
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise InvalidValueError(f"pipeline stage must be an int >= 0, got {i!r}",
                                    where=context.user_source_line(), fix="use pipeline.stage(0), stage(1), ...")
        previous, self._stage = self._stage, i
        try:
            yield
        finally:
            self._stage = previous

    def _stage_of(self, node: fx.Node) -> int | None:
        stage = node.meta.get(PIPELINE_STAGE)
        if stage is None and node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
            return self._stage_of(node.args[0]) if node.meta.get(OP) == "output_of" else None
        return stage

    def stash_and_restore_tensor(self, t: Tensor, from_stage: int | None = None) -> Tensor:
        """A tensor of an earlier stage, for use in the current stage (upstream's FIFO stash).

        ipuxl keeps each micro-batch's value (see the module docstring), so this returns ``t``.

        Raises:
            GraphContextError: (a RuntimeError, as upstream's) called outside a stage, or
                ``t`` has no producing stage and ``from_stage`` is not given.
        """
        if self._stage is None:
            raise GraphContextError("`stash_and_restore_tensor` must be called in a stage context.",
                                    where=context.user_source_line(), fix="call it under `with pipeline.stage(i):`")
        if from_stage is None and self._stage_of(t.node) is None:
            raise GraphContextError(
                f"If the tensor to be stashed ('{t.name}') does not have a producer in the pipeline, `from_stage` "
                "must be specified to `stash_and_restore_tensor`", where=context.user_source_line(),
                fix="pass from_stage=<the stage that produces it>")
        return t

    def stash_and_restore_activations(self, call_info: CallSiteInfo,
                                      grad_info: "GradGraphInfo") -> dict[Tensor, Tensor]:
        """The activations ``grad_info``'s graph reads from forward call ``call_info``,
        for a gradient call in the current stage (upstream stashes them in the forward's
        stage and restores them here)."""
        activations = grad_info.inputs_dict(call_info)
        return {sg: self.stash_and_restore_tensor(act) if self._stage_of(act.node) is not None else act
                for sg, act in activations.items()}


@contextlib.contextmanager
def pipelined_execution(steps: int) -> Iterator[PipelineContext]:
    """Run the ops of this context as a pipeline over ``steps`` micro-batches (popxl.addons').

    Args:
        steps: micro-batches per run of the pipeline: each stage runs ``steps`` times.

    Raises:
        GraphContextError: (a RuntimeError) an op is built outside a ``pipeline.stage(i)``.
        InvalidValueError: (a ValueError, as upstream's) ``steps`` < 2 x the number of
            stages, or stages are not numbered 0, 1, ... in program order.

    Example:
        >>> with addons.pipelined_execution(8) as pipeline:
        ...     with pipeline.stage(0), popxl.ipu(0):
        ...         x = ops.host_load(x_stream).copy_to_ipu(1)
        ...     with pipeline.stage(1), popxl.ipu(1):
        ...         ops.host_store(y_stream, x * 2)
    """
    graph = context.gcg()
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidValueError(f"pipelined_execution needs steps, an int >= 1; got {steps!r}",
                                where=context.user_source_line(), fix="pass the number of micro-batches")
    before = set(graph.fx.nodes)
    stages = PipelineContext(graph)
    handle = graph.register_op_created_hook(stages.hook)
    try:
        yield stages
    finally:
        graph.remove_op_created_hook(handle)
    _Pipeline(graph, steps, stages).apply([n for n in graph.fx.nodes if n not in before])


class _Pipeline:
    """The transform of one ``pipelined_execution`` context (see the module docstring)."""

    def __init__(self, graph: Graph, steps: int, stages: PipelineContext):
        self.graph, self.steps, self.context = graph, steps, stages

    def apply(self, region: list[fx.Node]) -> None:
        stage_of: dict[fx.Node, int] = {}
        for node in region:
            stage = self.context._stage_of(node)
            if stage is not None:
                stage_of[node] = stage
        staged = list(stage_of)
        if not staged:
            return
        numbers = sorted(set(stage_of.values()))
        if numbers != list(range(len(numbers))):
            raise InvalidValueError(f"pipeline stages must be numbered 0, 1, ..., got stages {numbers}",
                                    where=context.user_source_line(), fix="number the stages from 0 without gaps")
        if self.steps < 2 * len(numbers):
            raise InvalidValueError(
                "Pipelining requires the steps at least 2x the number of stages in the pipeline. "
                f"steps={self.steps} stages={len(numbers)}", where=context.user_source_line(),
                fix=f"use pipelined_execution({2 * len(numbers)}) or more, or fewer stages")
        self.split = _Splitter(self.graph, stage_of, numbers)
        self.split.split(staged)  # 1. move each op into its stage's graph, in program order
        self.split.add_outputs()
        for g in self.split.graphs.values():
            for t in g.inputs:  # by reference where the stage writes it (accumulators, optimiser state)
                t.node.meta[BY_REF] = is_written(g, t.node)
        self._erase(staged)
        self._schedule(numbers)  # 2. call the stages in pipeline order

    def _erase(self, staged: list[fx.Node]) -> None:
        for node in reversed(staged):
            self.graph.fx.erase_node(node)
        for slot in self.split.moved_slots:
            if not slot.users:
                self.graph.fx.erase_node(slot)
        self.graph.replace_body(self.graph.fx, {})

    # -- 2. the schedule ------------------------------------------------------------------
    def _stage_ipu(self, stage: int) -> int:
        ipus = Counter(int(n.meta[IPU]) for n in self.context.ops.get(stage, [])
                       if IPU in n.meta and n.meta.get(OP) != "ipu_copy")
        return ipus.most_common(1)[0][0] if ipus else 0

    def _schedule(self, numbers: list[int]) -> None:
        values: dict[tuple[fx.Node, int], Tensor] = {}
        ipus = {s: self._stage_ipu(s) for s in numbers}
        current = [0]  # the stage whose call is being built

        def record_stage(node: fx.Node) -> None:
            node.meta[PIPELINE_STAGE] = current[0]

        handle = self.graph.register_op_created_hook(record_stage)
        try:
            with self.graph, in_sequence(True), placement.unchecked():
                for stage, micro_batch in pipeline_schedule(len(numbers), self.steps).steps():
                    args = [values[(orig, micro_batch)] if from_stage is not None else self.graph.wrap(orig)
                            for orig, from_stage in self.split.inputs[stage]]
                    current[0] = stage
                    with placement.ipu(ipus[stage]):
                        info = call_with_info(self.split.graphs[stage], *args)
                    for original, out in zip(self.split.exports[stage], info.outputs):
                        lives_on = placement.ipu_of(self.split.copies[stage][original])  # a copy's destination
                        if lives_on is not None:
                            out.node.meta[IPU] = lives_on
                        values[(original, micro_batch)] = out
        finally:
            self.graph.remove_op_created_hook(handle)


class _Splitter(StageSplitter):
    """Stage graphs ``pipeline_stage_<i>``, made up front in stage order; a host store's
    slot moves with its op; an input keeps the IPU its tensor lives on."""

    def __init__(self, graph: Graph, stage_of: dict[fx.Node, int], numbers: list[int]):
        super().__init__(graph, stage_of)
        self.made = {s: graph.ir.create_empty_graph(f"pipeline_stage_{s}") for s in numbers}
        self.moved_slots: list[fx.Node] = []

    def new_graph(self, stage: int) -> Graph:
        return self.made[stage]

    def refuse_later(self, stage: int, node: fx.Node, later: int) -> Exception:
        return InvalidValueError(
            f"pipeline stage {stage} reads tensor '{self.graph.wrap(node).name}' of the later stage {later}",
            where=context.user_source_line(), fix="a stage may only read tensors of its own or earlier stages")

    def read_outside(self, graph: Graph, node: fx.Node) -> fx.Node | None:
        if node.op != "placeholder" or node.meta.get(ROLE) != Role.D2H:
            return None
        slot = graph.add_input(self.graph.wrap(node).spec, str(node.meta.get(NAME, node.name)), role=Role.D2H)
        slot.node.meta[STREAM] = node.meta[STREAM]
        self.moved_slots.append(node)
        return slot.node

    def add_input(self, graph: Graph, node: fx.Node) -> fx.Node:
        new = super().add_input(graph, node)
        lives_on = placement.ipu_of(node)
        if lives_on is not None:
            new.meta[IPU] = lives_on
        return new
