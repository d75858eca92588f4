"""The pipeline schedule: which stage runs which micro-batch in each cycle.

A pipelined IPU program (PopTorch ``PipelinedExecution``, popxl.addons
``pipelined_execution``) runs its stages in the textbook order: in cycle ``c`` stage
``s`` works on micro-batch ``c - s``. The first ``stages - 1`` cycles fill the pipeline
(ramp-up), then every stage is busy (steady state) until the last micro-batch has
entered, and ``stages - 1`` cycles drain it (ramp-down): ``micro_batches + stages - 1``
cycles in all. Stage ``s`` sees the micro-batches in order, so results equal running
the micro-batches one after another.

Both front ends build their programs in this order (``pipeline_schedule``); the
report shows it with the idle fraction of each IPU (a cycle in which no stage of an
IPU runs is idle for that IPU; every stage step counts one cycle slot).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from ipuxl.errors import InvalidValueError

__all__ = ["PipelineSchedule", "pipeline_schedule", "Phase"]

Phase = Literal["ramp-up", "steady", "ramp-down"]


@dataclass(frozen=True)
class PipelineSchedule:
    """The cycles of a pipeline: ``cycles[c]`` lists ``(stage, micro_batch)`` in stage order.

    Attributes:
        stages: number of pipeline stages.
        micro_batches: micro-batches run through the pipeline (gradient accumulation steps).
        cycles: per cycle, the (stage, micro-batch) steps that run in it.
    """

    stages: int
    micro_batches: int
    cycles: tuple[tuple[tuple[int, int], ...], ...]

    def phase(self, cycle: int) -> Phase:
        """Whether ``cycle`` fills the pipeline, runs it full, or drains it."""
        if cycle < self.stages - 1:
            return "ramp-up"
        if cycle < self.micro_batches:
            return "steady"
        return "ramp-down"

    def steps(self) -> list[tuple[int, int]]:
        """Every (stage, micro-batch) step in execution order."""
        return [step for cycle in self.cycles for step in cycle]

    def idle_fraction(self, stage_ipus: Mapping[int, int] | Sequence[int] | None = None) -> dict[int, float]:
        """Per IPU, the fraction of cycles in which none of its stages runs.

        Args:
            stage_ipus: the IPU of each stage (default: stage ``s`` on IPU ``s``).
        """
        ipus = dict(enumerate(stage_ipus)) if isinstance(stage_ipus, Sequence) else dict(stage_ipus or {})
        ipus = {s: ipus.get(s, s) for s in range(self.stages)}
        total = len(self.cycles)
        return {ipu: 1.0 - sum(1 for cycle in self.cycles if any(ipus[s] == ipu for s, _ in cycle)) / total
                for ipu in sorted(set(ipus.values()))}

    def format(self, stage_ipus: Mapping[int, int] | None = None) -> str:
        """A text grid: one row per stage, one column per cycle, the micro-batch in each cell."""
        width = max(2, len(str(len(self.cycles) - 1)))
        labels = [f"stage {s}" + (f" (IPU {stage_ipus[s]})" if stage_ipus and s in stage_ipus else "")
                  for s in range(self.stages)]
        pad = max(len(label) for label in [*labels, "cycle"]) + 1
        rows = ["cycle".ljust(pad) + " ".join(f"{c:>{width}}" for c in range(len(self.cycles)))]
        for s, label in enumerate(labels):
            cells = {c: m for c, cycle in enumerate(self.cycles) for st, m in cycle if st == s}
            rows.append(label.ljust(pad) + " ".join(f"{cells[c]:>{width}}" if c in cells else ".".rjust(width)
                                                    for c in range(len(self.cycles))))
        return "\n".join(rows)


def pipeline_schedule(stages: int, micro_batches: int) -> PipelineSchedule:
    """The textbook schedule of ``stages`` stages over ``micro_batches`` micro-batches.

    Cycle ``c`` runs stage ``s`` on micro-batch ``c - s`` for every stage with
    ``0 <= c - s < micro_batches``, in stage order.

    Raises:
        InvalidValueError: (a ValueError) a count below 1.

    Example:
        >>> pipeline_schedule(2, 3).cycles
        (((0, 0),), ((0, 1), (1, 0)), ((0, 2), (1, 1)), ((1, 2),))
    """
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidValueError(f"pipeline_schedule: {name} must be an int >= 1, got {value!r}",
                                    fix=f"pass the number of {name.replace('_', '-')}")
    cycles = tuple(tuple((s, c - s) for s in range(stages) if 0 <= c - s < micro_batches)
                   for c in range(micro_batches + stages - 1))
    return PipelineSchedule(stages, micro_batches, cycles)
