"""PopTorch's performance counters and latencies of a model's last call.

``PoplarExecutor.getPerfCounters()`` returns upstream's dict: the keys ``input``,
``input_complete``, ``output`` and ``output_complete``, each a list per input (or
output) tensor of one timestamp per device iteration, in fractional seconds from an
undefined reference (``time.perf_counter``).

What ipuxl measures: its ``Session`` runs all device iterations of a call in one
``run`` and does not time them one by one, so every iteration's entry holds the
call's own four host timestamps: ``input`` when the call started handing over its
inputs, ``input_complete`` when they were split into the device's streams (the
session copies them at the start of ``run``), ``output`` when ``run`` returned (the
device loop finished) and ``output_complete`` when the outputs were copied into the
returned tensors. The latencies (``getLatency``...) are therefore the same for
every iteration: min, max and average are equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["CallTimes", "EVENTS", "perf_counters", "latency"]

EVENTS = ("input", "input_complete", "output", "output_complete")


@dataclass(frozen=True)
class CallTimes:
    """The four host timestamps of one call and how many tensors and iterations it had."""

    input: float
    input_complete: float
    output: float
    output_complete: float
    n_inputs: int
    n_outputs: int
    iterations: int


def perf_counters(times: CallTimes | None) -> dict[str, list[list[float]]]:
    """Upstream's counters dict for the last call (``[[]]`` per event before any call)."""
    if times is None:
        return {event: [[]] for event in EVENTS}
    out = {}
    for event in EVENTS:
        count = times.n_inputs if event.startswith("input") else times.n_outputs
        rows = [[getattr(times, event)] * times.iterations for _ in range(count)]
        out[event] = rows if rows else [[]]
    return out


def latency(counters: dict[str, list[list[float]]], start: str, start_reduce: Callable[[list[float]], float],
            end: str, end_reduce: Callable[[list[float]], float]) -> tuple[float, float, float]:
    """``(min, max, average)`` over iterations of ``end`` minus ``start`` (PopTorch's
    ``_computeLatency``: each iteration's start reduced over the inputs with
    ``start_reduce``, its end over the outputs with ``end_reduce``; ``(0, 0, 0)``
    without timestamps)."""
    starts = _per_iteration(counters[start], start_reduce)
    ends = _per_iteration(counters[end], end_reduce)
    if not ends or not starts:
        return (0.0, 0.0, 0.0)
    factor = max(len(starts) // len(ends), 1)
    durations = [e - min(starts[i * factor:(i + 1) * factor]) for i, e in enumerate(ends)]
    return (min(durations), max(durations), sum(durations) / len(durations))


def _per_iteration(rows: list[list[float]], reduce: Callable[[list[float]], float]) -> list[float]:
    if not rows or not rows[0]:
        return []
    return [reduce([row[step] for row in rows]) for step in range(len(rows[0]))]
