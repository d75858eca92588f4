"""Trace-time placement: the PopTorch blocks a capture meets give its ops their stage and IPU.

While ``compile_model`` captures a model (``with placement(options.execution_strategy)``),
each block start (``poptorch.Block``, ``BeginBlock``, ``BlockFunction``: ``blocks``)
reaches the capture's ``Placement``:

1. entering a block asks the strategy's stage manager (``blocks.stage_manager``) for
   the block's stage and IPU, as upstream's ``Block._stages_manager`` does;
2. every op the trace records after a block starts, up to the next block start, gets
   that block's ``ipuxl.ir.meta.IPU`` and ``PIPELINE_STAGE`` (``Placement.finish``
   places the last ones); ops before the first block belong to stage 0;
3. ``Placement.finish`` checks the stages (numbered from 0 without gaps; a pipelined
   op never reads a later stage's value) and returns the ``StagePlan``;
4. ``check_depth`` refuses a pipeline too shallow for its stages (PopART's message).

A stage manager's error is kept and raised by ``finish``, after the trace: raised
inside it, torch would wrap it as a trace failure.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ipuxl.errors import ExecutorError, OptionsError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.meta import IPU, PIPELINE_STAGE
from ipuxl.poptorch_compat.blocks import PipelinedExecution, listening_to_blocks, stage_manager

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["StagePlan", "Placement", "placement", "check_depth"]


@dataclass
class StagePlan:
    """The stages a captured model uses and how they run.

    Attributes:
        kind: "pipelined", "sharded" or "phased".
        ipus: the IPU of each stage, by stage number (0..N-1).
        blocks: the blocks of each stage, in the order they ran.
    """

    kind: str
    ipus: list[int]
    blocks: list[list[str]] = field(default_factory=list)
    graphs: list[Graph] = field(default_factory=list)
    """The forward (and grad) graph whose ops carry the placement, each run once per micro-batch."""

    @property
    def num_stages(self) -> int:
        return len(self.ipus)

    @property
    def num_ipus(self) -> int:
        """The IPUs the model uses (PopTorch counts them from 0 to the highest used)."""
        return max(self.ipus) + 1 if self.ipus else 1

    def pipeline_stages(self, training: bool) -> int:
        """The pipeline stages PopART counts: forward stages, plus the backward ones in
        training (the last forward stage is also the first backward one)."""
        return 2 * self.num_stages - 1 if training else self.num_stages

    def describe(self) -> str:
        """One line per stage: its IPU and blocks."""
        rows = [f"{self.kind} execution over {self.num_ipus} IPUs, {self.num_stages} stages:"]
        rows += [f"  stage {s}: IPU {ipu}, blocks {', '.join(self.blocks[s]) or '(none)'}"
                 for s, ipu in enumerate(self.ipus)]
        return "\n".join(rows)


class Placement:
    """The blocks a capture meets, and the ops each covers (see the module docstring)."""

    def __init__(self, strategy: Any):
        self.strategy = strategy if strategy is not None else PipelinedExecution()
        self.manager = stage_manager(self.strategy)
        self._current: dict[fx.Graph, tuple[fx.Node, int, int]] = {}  # graph -> (last node placed, stage, ipu)
        self._stages: dict[int, int] = {}  # stage -> IPU
        self._blocks: dict[int, list[str]] = {}
        self._error: OptionsError | None = None

    def begin(self, user_id: str | None, ipu_id: int | None) -> None:
        """Block ``user_id`` starts: ops recorded from now on are its stage's."""
        if self._error is not None:
            return
        block = str(user_id) if user_id is not None else self.manager.nextAutoId()
        try:
            number, ipu = self.manager.place(block, ipu_id)
        except OptionsError as exc:  # raised after the trace (finish): torch would wrap it as a trace failure
            self._error = exc
            return
        if self._stages.setdefault(number, ipu) != ipu:
            self._error = OptionsError(
                f"stage {number} placed on IPU {self._stages[number]} and on IPU {ipu} (block '{block}')",
                where=user_source_line(), fix="give every block of a stage the same ipu_id, or set Stage(...).ipu(n)")
            return
        if block not in self._blocks.setdefault(number, []):
            self._blocks[number].append(block)
        mode = get_proxy_mode()
        if mode is None:  # not tracing (a dry run on meta tensors): nothing to place
            return
        graph = mode.tracer.graph
        self._place_pending(graph)
        self._current[graph] = (_last_node(graph), number, ipu)

    def _place_pending(self, graph: fx.Graph) -> None:
        """Give the ops recorded since the last block start their block's stage and IPU."""
        last, stage, ipu = self._current.get(graph, (None, 0, self._stages.get(0, 0)))
        nodes = list(graph.nodes)
        for node in nodes[nodes.index(last) + 1 if last is not None else 0:]:
            if node.op not in ("placeholder", "output"):
                node.meta[IPU], node.meta[PIPELINE_STAGE] = ipu, stage

    def finish(self, gm: fx.GraphModule) -> StagePlan | None:
        """Place the trace's last ops and check the stages: the plan, or None when the
        model has no blocks (one IPU, no pipeline)."""
        if self._error is not None:
            raise self._error
        if not self._stages:
            return None
        if gm.graph in self._current:
            self._place_pending(gm.graph)
        missing = [s for s in range(len(self._stages)) if s not in self._stages]
        if missing:
            raise OptionsError(f"The set of pipeline stages for all Ops contains {len(self._stages)} stages, but "
                               f"stage {missing[0]} is missing (stages used: {sorted(self._stages)})",
                               where=user_source_line(),
                               fix="number the stages from 0 without gaps (with AutoStage.SameAsIpu: the blocks' "
                                   "ipu_id)")
        kind = getattr(self.strategy, "kind", "pipelined")
        if kind == "pipelined":
            _check_stage_order(gm.graph)
        count = len(self._stages)
        return StagePlan(kind, [self._stages[s] for s in range(count)], [self._blocks.get(s, []) for s in range(count)])


def _last_node(graph: fx.Graph) -> fx.Node:
    *_, last = graph.nodes
    return last


def _check_stage_order(graph: fx.Graph) -> None:
    """A pipelined op may not read a value computed in a later stage (PopART refuses it)."""
    for node in graph.nodes:
        stage = node.meta.get(PIPELINE_STAGE)
        if stage is None:
            continue
        for source in node.all_input_nodes:
            produced = source.meta.get(PIPELINE_STAGE)
            if produced is not None and produced > stage:
                raise OptionsError(
                    f"Tensor {source.name} is consumed in an earlier pipeline stage ({stage}, by {node.name}) than "
                    f"it is produced ({produced})", where=user_source_line(),
                    fix="order the pipeline's stages as the model runs its blocks, or use ShardedExecution")


@contextlib.contextmanager
def placement(strategy: Any) -> Iterator[Placement]:
    """Blocks met while the body captures a model are placed by ``strategy``'s stages
    (``None``: PopTorch's default, ``PipelinedExecution(AutoStage.SameAsIpu)``)."""
    found = Placement(strategy)
    with listening_to_blocks(found):
        yield found


# -- checks -----------------------------------------------------------------------------------------
def check_depth(plan: StagePlan | None, *, training: bool, gradient_accumulation: int,
                device_iterations: int) -> None:
    """Refuse a pipeline with too few micro-batches to fill it (PopART's check and message).

    Raises:
        ExecutorError: pipelined training with ``gradientAccumulation`` below the number
            of pipeline stages (``2 * N - 1`` for N forward stages), or pipelined
            inference with ``deviceIterations`` below N.
    """
    if plan is None or plan.kind != "pipelined" or plan.num_stages < 2:
        return
    needed = plan.pipeline_stages(training)
    if training and gradient_accumulation < needed:
        raise ExecutorError(
            f"poptorch.Options().Training.gradientAccumulation must be greater than or equal to the number of "
            f"pipeline stages ({needed}) when using poptorch.PipelinedExecution. Please note that a model with "
            f"{plan.num_stages} pipeline stages in PopTorch will have an additional {needed - plan.num_stages} stages "
            f"when training. (gradientAccumulation is {gradient_accumulation})", where=user_source_line(),
            fix=f"set opts.Training.gradientAccumulation({needed}) or more, or use poptorch.ShardedExecution")
    if not training and device_iterations < needed:
        raise ExecutorError(
            f"poptorch.Options().deviceIterations must be greater than or equal to the number of pipeline stages "
            f"({needed}) when using PopTorch.PipelinedExecution. (deviceIterations is {device_iterations})",
            where=user_source_line(),
            fix=f"set opts.deviceIterations({needed}) or more, or use poptorch.ShardedExecution")
