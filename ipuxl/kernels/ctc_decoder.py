"""CTC beam search decoding (PopTorch's ``ctc_beam_search_decoder``) as a device kernel.

``torch.ops.ipuxl.ctc_beam_search_decoder`` is a torch custom op: a trace records it as
one node, and the device runs the prefix beam search below on the current values each
time the program runs. It has no gradient (decoding is not differentiable).

Prefix beam search over log-probabilities: each beam is a label prefix (repeats
merged, blanks removed) with the log-probability of the alignments that end in a
blank and of those that end in its last label; every time step extends each beam by
every class and keeps the ``beam_width`` most probable prefixes. A beam's score is the
log of the total probability of its alignments, so with a beam wide enough to keep
every prefix the result is exact.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["beam_search"]

_NEG_INF = float("-inf")
Beams = dict[tuple[int, ...], list[float]]  # prefix -> [log p(ends in blank), log p(ends in its last label)]


def _logadd(a: float, b: float) -> float:
    if a == _NEG_INF:
        return b
    if b == _NEG_INF:
        return a
    high, low = (a, b) if a > b else (b, a)
    return high + math.log1p(math.exp(low - high))


def _score(entry: Sequence[float]) -> float:
    return _logadd(entry[0], entry[1])


def _step(beams: Beams, log_probs: list[float], blank: int) -> Beams:
    """Extend every beam by one time step of ``log_probs`` (one per class)."""
    extended: Beams = {}

    def add(prefix: tuple[int, ...], slot: int, value: float) -> None:
        entry = extended.setdefault(prefix, [_NEG_INF, _NEG_INF])
        entry[slot] = _logadd(entry[slot], value)

    for prefix, (p_blank, p_label) in beams.items():
        total = _logadd(p_blank, p_label)
        for c, p in enumerate(log_probs):
            if c == blank:
                add(prefix, 0, total + p)
            elif prefix and prefix[-1] == c:  # a repeat extends only after a blank; else it merges
                add(prefix + (c,), 1, p_blank + p)
                add(prefix, 1, p_label + p)
            else:
                add(prefix + (c,), 1, total + p)
    return extended


def _best(beams: Beams, n: int) -> list[tuple[tuple[int, ...], list[float]]]:
    """The ``n`` most probable beams (ties: shorter, then smaller labels first)."""
    return sorted(beams.items(), key=lambda kv: (-_score(kv[1]), len(kv[0]), kv[0]))[:n]


def beam_search(log_probs: torch.Tensor, length: int, blank: int, beam_width: int,
                top_paths: int) -> list[tuple[float, tuple[int, ...]]]:
    """The ``top_paths`` best (log-probability, labels) of one sequence of ``log_probs`` [time, classes]."""
    rows = log_probs[:length].double().tolist()
    beams: Beams = {(): [0.0, _NEG_INF]}
    for row in rows:
        beams = dict(_best(_step(beams, row, blank), beam_width))
    return [(_score(entry), prefix) for prefix, entry in _best(beams, top_paths)]


@torch.library.custom_op("ipuxl::ctc_beam_search_decoder", mutates_args=())
def _decode(probs: torch.Tensor, lengths: torch.Tensor, blank: int, beam_width: int,
            top_paths: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    time, batch, _ = probs.shape
    scores = torch.full((batch, top_paths), _NEG_INF, dtype=probs.dtype)
    sizes = torch.zeros((batch, top_paths), dtype=torch.int32)
    paths = torch.zeros((batch, top_paths, time), dtype=torch.int32)
    for b in range(batch):
        length = max(0, min(int(lengths[b]), time))
        for k, (score, labels) in enumerate(beam_search(probs[:, b].cpu(), length, blank, beam_width, top_paths)):
            scores[b, k], sizes[b, k] = score, len(labels)
            paths[b, k, :len(labels)] = torch.tensor(labels, dtype=torch.int32)
    return scores.to(probs.device), sizes.to(probs.device), paths.to(probs.device)


@_decode.register_fake
def _(probs: torch.Tensor, lengths: torch.Tensor, blank: int, beam_width: int,
      top_paths: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    time, batch, _ = probs.shape
    return (probs.new_empty((batch, top_paths)), probs.new_empty((batch, top_paths), dtype=torch.int32),
            probs.new_empty((batch, top_paths, time), dtype=torch.int32))
