"""A pipelined training step: the stages of every micro-batch run in pipeline order.

With ``PipelinedExecution`` over N > 1 stages, ``program._build_step`` hands the
micro-batches of a training step to ``pipelined_micro_batches``, which

1. cuts the forward graph and the grad graph into one subgraph per pipeline stage
   (``stages.split_by_stage``): forward stages 0..N-1, backward stages N-1..2N-2 (the
   last forward stage is also the first backward one, as PopART numbers them);
2. calls them in the textbook order of a pipeline of ``2N - 1`` stages over the
   step's G micro-batches (``ipuxl.device.pipeline.pipeline_schedule``): in cycle ``c``
   pipeline stage ``p`` works on micro-batch ``c - p`` (ramp-up, steady state,
   ramp-down), the forward part of stage N-1 before its backward part;
3. writes each buffer a stage updates (BatchNorm's running statistics) right after
   that stage's call, so the next micro-batch's call of the stage reads it, as one
   micro-batch after another would; stores the outputs and returns each micro-batch's
   gradients, which the step sums in micro-batch order.

Every stage sees the micro-batches in order and reads only its own micro-batch's
values, so the results equal the step without pipelining, bit for bit.

**Pipelined inference** spans device iterations, as PopART's (``batchesPerStep`` is the
pipeline's depth): ``pipelined_inference`` builds the whole run as one step (the main
graph's ``repeat`` runs it once) that loads each of the ``deviceIterations`` micro-batches
when stage 0 first needs it, calls the N forward stages in pipeline order over them
(``pipeline_schedule(N, deviceIterations)``) and stores each micro-batch's outputs
after its last stage, in order, so the host streams see the same ``deviceIterations``
transfers as without pipelining and the results equal unsplit inference.

Without a split (sharded or phased execution, a single stage, a graph the stages cannot
be cut from; for inference also a model that draws random numbers, updates buffers or
inputs in place, or anchors tensors) the step calls the whole forward and grad graphs
per micro-batch, and ``report()`` still shows the schedule a pipeline would run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ipuxl.device.pipeline import pipeline_schedule
from ipuxl.errors import OptionsError
from ipuxl.ir.grad_info import ExpectedConnectionType
from ipuxl.ir.context import gcg
from ipuxl.ir.meta import CALLED_GRAPH, IPU, PIPELINE_STAGE
from ipuxl.ops import cast, host_load, host_store
from ipuxl.ops.call import call
from ipuxl.ops.var_updates import copy_var_update_
from ipuxl.poptorch_compat.compile.stages import FromInput, FromStage, Source, StageSplit, split_by_stage

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.tensor import Tensor, Variable
    from ipuxl.poptorch_compat.compile.program import Gradients, Program

__all__ = ["pipelined_micro_batches", "pipelined_inference"]


def pipelined_micro_batches(program: Program, forward: Graph, gradients: Gradients | None, loaded: list[Tensor],
                            seeds: list[Tensor | None], loss_grad: Tensor | None,
                            inputs: dict[Variable, Tensor]) -> list[tuple[Tensor, ...]] | None:
    """Run the step's micro-batches through the pipeline (see the module docstring).

    Returns:
        Each micro-batch's gradients of the trained parameters, or None when the step is
        not a pipeline (the caller then runs the micro-batches one after another).
    """
    plan = program.stages
    if (plan is None or plan.kind != "pipelined" or plan.num_stages < 2 or gradients is None
            or not gradients.trained or loss_grad is None or program.anchors is not None
            or program.micro_batches < plan.pipeline_stages(True)):
        return None
    try:
        forward_split = split_by_stage(forward, f"{program.traced.name}_forward")
        grad_split = split_by_stage(gradients.info.graph, f"{program.traced.name}_backward")
    except OptionsError:  # a value read before the stage that makes it: run the micro-batches in turn
        return None
    return _Pipeline(program, forward, gradients, forward_split, grad_split, loaded, seeds, loss_grad, inputs).run()


class _Pipeline:
    """The wiring of one pipelined step (values per stage call and micro-batch)."""

    def __init__(self, program: Program, forward: Graph, gradients: Gradients, forward_split: StageSplit,
                 grad_split: StageSplit, loaded: list[Tensor], seeds: list[Tensor | None], loss_grad: Tensor,
                 inputs: dict[Variable, Tensor]):
        self.program, self.forward, self.gradients = program, forward, gradients
        self.fwd, self.grad = forward_split, grad_split
        self.loss_grad, self.inputs = loss_grad, inputs
        self.fwd_outs: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        self.grad_outs: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        self.args = [self._forward_args(loaded, seeds[g], g) for g in range(program.micro_batches)]
        self.forward_index = {t.node: i for i, t in enumerate(forward.outputs)}
        self.forward_input = {t.node: i for i, t in enumerate(forward.inputs)}

    def _forward_args(self, loaded: list[Tensor], seed: Tensor | None, g: int) -> list[Tensor]:
        """The forward graph's arguments for micro-batch ``g`` (as ``program._micro_batch``)."""
        program, traced = self.program, self.program.traced
        xs = [x[g * s.shape[0]:(g + 1) * s.shape[0]] for x, s in zip(loaded, traced.input_specs)]
        buffers = [program.float_statistics.get(n, program.buffers[n]) for n in traced.buffers]
        args = xs + [self.inputs[program.params[n]] for n in traced.params] + [self.inputs[v] for v in buffers]
        return args + ([seed] if seed is not None else [])

    # -- values ---------------------------------------------------------------------------------
    def forward_value(self, source: Source, g: int) -> Tensor:
        if isinstance(source, FromInput):
            return self.args[g][source.index]
        return self.fwd_outs[(source.stage, g)][source.index]

    def forward_output(self, j: int, g: int) -> Tensor:
        return self.forward_value(self.fwd.outputs[j], g)

    def grad_input(self, i: int, g: int) -> Tensor:
        connection = self.gradients.info.expected_inputs[i]
        if connection.connection_type is ExpectedConnectionType.FwdGrad:
            return self.loss_grad  # the only gradient provided: the loss's
        node = connection.fwd_tensor.node
        if node in self.forward_input:
            return self.args[g][self.forward_input[node]]
        return self.forward_output(self.forward_index[node], g)

    def grad_value(self, source: Source, g: int) -> Tensor:
        if isinstance(source, FromInput):
            return self.grad_input(source.index, g)
        return self.grad_outs[(source.stage, g)][source.index]

    # -- the schedule -------------------------------------------------------------------------------
    def run(self) -> list[tuple[Tensor, ...]]:
        plan, count = self.program.stages, self.program.micro_batches
        assert plan is not None
        for stage, g in pipeline_schedule(plan.pipeline_stages(True), count).steps():
            if stage in self.fwd.graphs:
                args = [self.forward_value(s, g) for s in self.fwd.inputs[stage]]
                self.fwd_outs[(stage, g)] = _call_stage(self.fwd, stage, args)
                self._write_buffers(g, stage)
            if stage in self.grad.graphs:
                args = [self.grad_value(s, g) for s in self.grad.inputs[stage]]
                self.grad_outs[(stage, g)] = _call_stage(self.grad, stage, args)
        results = []
        for g in range(count):
            self._write_buffers(g, None)
            self._store(g)
            results.append(tuple(self.grad_value(s, g) for s in self.grad.outputs))
        return results

    def _write_buffers(self, g: int, stage: int | None) -> None:
        """Write the buffers the forward updates whose new value stage ``stage`` computes
        (``None``: those it passes through unchanged), as ``program._micro_batch`` does."""
        program, traced = self.program, self.program.traced
        for k, name in enumerate(traced.mutated):
            source = self.fwd.outputs[traced.n_outputs + k]
            if (stage is None) != isinstance(source, FromInput):
                continue
            if isinstance(source, FromStage) and source.stage != stage:
                continue
            new = self.forward_value(source, g)
            target = program.params[name] if name in program.params else program.buffers[name]
            if name in program.float_statistics:
                copy_var_update_(self.inputs[program.float_statistics[name]], new)
                new = cast(new, torch.float16)
            copy_var_update_(self.inputs[target], new)

    def _store(self, g: int) -> None:
        """Store micro-batch ``g``'s outputs and new values of inputs written in place."""
        program, traced = self.program, self.program.traced
        for j in range(traced.n_outputs):
            host_store(program.outputs[j][g], self.forward_output(j, g))
        first_update = traced.n_outputs + len(traced.mutated)
        for k, (_, streams) in enumerate(program.input_updates):
            host_store(streams[g], self.forward_output(first_update + k, g))


def _call_stage(split: StageSplit, stage: int, args: list[Tensor]) -> tuple[Tensor, ...]:
    """Call stage ``stage``'s subgraph; the call records its pipeline stage and IPU."""
    called = split.graphs[stage]
    outputs = call(called, *args)
    node = next(n for n in reversed(gcg().fx.nodes) if n.meta.get(CALLED_GRAPH) is called)  # the call just built
    node.meta[PIPELINE_STAGE] = stage
    if stage in split.ipus:
        node.meta[IPU] = split.ipus[stage]
    return tuple(outputs)


def pipelined_inference(program: Program, forward: Graph, inputs: dict[Variable, Tensor], iterations: int) -> bool:
    """Build a pipelined inference run over ``iterations`` device iterations in the current
    (step) graph (see the module docstring). False, building nothing, when the program is
    not a pipeline that can run so: the caller then builds the usual one-iteration step."""
    plan, traced = program.stages, program.traced
    if (plan is None or plan.kind != "pipelined" or plan.num_stages < 2 or program.training
            or iterations < plan.num_stages or program.anchors is not None or program.seed is not None
            or traced.mutated or program.input_updates or program.float_statistics):
        return False
    try:
        split = split_by_stage(forward, f"{traced.name}_forward")
    except OptionsError:
        return False
    params = [inputs[program.params[n]] for n in traced.params] + [inputs[program.buffers[n]] for n in traced.buffers]
    args: dict[int, list[Tensor]] = {}
    outs: dict[tuple[int, int], tuple[Tensor, ...]] = {}

    def value(source: Source, d: int) -> Tensor:
        if isinstance(source, FromInput):
            return args[d][source.index]
        return outs[(source.stage, d)][source.index]

    for stage, d in pipeline_schedule(plan.num_stages, iterations).steps():
        if d not in args:  # micro-batch d arrives when the pipeline first needs it
            args[d] = [host_load(stream, name) for stream, name in zip(program.inputs, traced.input_names)] + params
        if stage in split.graphs:
            outs[(stage, d)] = _call_stage(split, stage, [value(s, d) for s in split.inputs[stage]])
        if stage == plan.num_stages - 1:
            for j in range(traced.n_outputs):  # leaves after its last stage, in micro-batch order
                host_store(program.outputs[j][0], value(split.outputs[j], d))
    return True
