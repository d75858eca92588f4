"""What a PopTorch program adds to its device report: the copies between stages and the pipeline schedule.

``PoplarExecutor.report()`` is the device ``Session``'s ``ProgramReport`` of the compiled
program (memory and FLOPs per IPU come from ``device.ipus.ipu_report``, which charges
each op of the stage graphs to its own IPU), completed by ``annotate_report`` with what
the ``StagePlan`` knows: the bytes PopTorch copies between IPUs at stage boundaries, and
for a pipeline its schedule (``pipeline_schedule_of``) with each IPU's idle fraction.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from ipuxl.device.pipeline import PipelineSchedule, pipeline_schedule
from ipuxl.ir.meta import IPU
from ipuxl.passes.liveness import tensor_bytes

if TYPE_CHECKING:
    from ipuxl.device.report import ProgramReport
    from ipuxl.poptorch_compat.compile.program import Program

__all__ = ["pipeline_schedule_of", "annotate_report"]


def pipeline_schedule_of(program: Program, device_iterations: int) -> tuple[PipelineSchedule, dict[int, int]] | None:
    """The schedule a pipelined IPU program of ``program`` runs, and each pipeline stage's IPU.

    Training runs ``2 * N - 1`` pipeline stages (forward stages, then the backward ones on
    the same IPUs in reverse order) over the gradient accumulation's micro-batches;
    inference runs the N forward stages over the device iterations. None: not pipelined.
    """
    plan = program.stages
    if plan is None or plan.kind != "pipelined" or plan.num_stages < 2:
        return None
    count = plan.pipeline_stages(program.training)
    last = 2 * plan.num_stages - 2
    stage_ipus = {s: plan.ipus[s if s < plan.num_stages else last - s] for s in range(count)}
    micro_batches = program.micro_batches if program.training else device_iterations
    return pipeline_schedule(count, micro_batches), stage_ipus


def annotate_report(report: ProgramReport, program: Program, device_iterations: int) -> ProgramReport:
    """Complete the per-IPU part of a PopTorch program's report: the copies PopTorch inserts
    at stage boundaries and the pipeline schedule with each IPU's idle fraction. (Memory and
    FLOPs per IPU come from ``device.ipus.ipu_report``, which charges each op of the stage
    graphs to its own IPU.)"""
    ipus = report.ipus
    if program.stages is None or ipus is None:
        return report
    runs = program.micro_batches * program.ir.num_host_transfers
    for (source, destination), size in _stage_copies(program, runs).items():
        ipus.copies[(source, destination)] = ipus.copies.get((source, destination), 0) + size
        if max(source, destination) < len(ipus.ipus):
            ipus.ipus[source].copy_out_bytes += size
            ipus.ipus[destination].copy_in_bytes += size
    found = pipeline_schedule_of(program, device_iterations)
    if found is not None:
        ipus.schedule, ipus.stage_ipus = found
        for ipu, idle in ipus.schedule.idle_fraction(ipus.stage_ipus).items():
            if ipu < len(ipus.ipus):
                ipus.ipus[ipu].idle_fraction = idle
    return report


def _stage_copies(program: Program, runs: int) -> dict[tuple[int, int], int]:
    """(source IPU, destination IPU) -> bytes per run that cross IPUs between the ops of
    the forward and grad graphs (the copies PopTorch inserts at stage boundaries)."""
    found: dict[tuple[int, int], int] = {}
    assert program.stages is not None
    for graph in program.stages.graphs:
        sent: set[tuple[fx.Node, int]] = set()
        for node in graph.fx.nodes:
            destination = node.meta.get(IPU)
            if destination is None or node.op != "call_function":
                continue
            for source in node.all_input_nodes:
                there = source.meta.get(IPU)
                if there is None or there == destination or (source, destination) in sent:
                    continue
                sent.add((source, destination))
                key = (int(there), int(destination))
                found[key] = found.get(key, 0) + runs * tensor_bytes(source.meta.get("val"))
    return found
