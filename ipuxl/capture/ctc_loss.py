"""``F.ctc_loss`` / ``nn.CTCLoss`` with static shapes, as a capture runs them.

torch's ``aten._ctc_loss`` sizes its outputs from the *values* of the length tensors
(its work tensors are ``max(input_lengths) x (2 * max(target_lengths) + 1)``), so it
cannot be traced. ``ctc_loss`` computes the same loss from ops whose shapes follow from
the input shapes: the CTC forward (alpha) recursion in log space, unrolled over the ``T``
time steps of ``log_probs``, over the ``2 * S + 1`` positions of the blank-extended
targets, where ``S`` is the padded target width (2-D targets) or the total target
length (1-D concatenated targets); each sample's lengths select what counts.

* Unreachable states hold a very negative finite number, not ``-inf``: the gradient of
  a log-sum-exp of ``-inf`` operands is NaN, which would reach the inputs.
  A sample with no valid alignment gives ``inf`` (0 with ``zero_infinity``, with a zero
  gradient), as eager.
* The gradient is eager's: torch's CTC backward returns, for ``t < input_length``,
  ``exp(log_probs)`` minus the alignment posteriors divided by the probability, the
  gradient of the loss with respect to the logits when ``log_probs`` come from a
  ``log_softmax`` (the usual case: both give the same logit gradient). A zero-valued
  term ``e - e.detach()`` with ``e`` the sum of ``exp(log_probs)`` over the valid
  steps adds that ``exp(log_probs)`` part.
* ``reduction``: ``'none'`` gives the per-sample losses, ``'sum'`` their sum, ``'mean'``
  the mean over the batch of each loss divided by its target length (at least 1).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

__all__ = ["CTC_FUNCTIONS", "ctc_loss"]

CTC_FUNCTIONS = frozenset({F.ctc_loss, torch.ctc_loss})

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # torch.ctc_loss's int reductions (at::Reduction)
_ARGS = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "reduction", "zero_infinity")


def ctc_loss(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``func(*args, **kwargs)`` (``F.ctc_loss`` or ``torch.ctc_loss``) with static shapes."""
    a: dict[str, Any] = {"blank": 0, "reduction": "mean", "zero_infinity": False}
    a.update(zip(_ARGS, args))
    a.update(kwargs)
    reduction = _REDUCTIONS.get(a["reduction"], a["reduction"]) if isinstance(a["reduction"], int) else a["reduction"]
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    log_probs: torch.Tensor = a["log_probs"]
    unbatched = log_probs.dim() == 2
    if unbatched:  # (T, C) with (S,) targets and scalar lengths
        log_probs, targets = log_probs.unsqueeze(1), a["targets"].unsqueeze(0)
    else:
        targets = a["targets"]
    n = log_probs.shape[1]
    input_lengths = _lengths(a["input_lengths"], n, log_probs.device)
    target_lengths = _lengths(a["target_lengths"], n, log_probs.device)
    dtype = log_probs.dtype
    compute = log_probs.float() if dtype in (torch.float16, torch.bfloat16) else log_probs
    losses = _ctc(compute, targets, input_lengths, target_lengths, int(a["blank"]), bool(a["zero_infinity"]))
    losses = losses.to(dtype)
    if reduction == "mean":
        return (losses / target_lengths.clamp(min=1).to(dtype)).mean()
    if reduction == "sum":
        return losses.sum()
    return losses[0] if unbatched else losses


def _lengths(value: Any, n: int, device: torch.device) -> torch.Tensor:
    """A length argument (tensor, int or sequence of ints) as an int64 tensor of ``n`` values."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(torch.int64).expand(n) if value.numel() == 1 else value.to(torch.int64)
    if isinstance(value, int):
        return torch.full((n,), value, dtype=torch.int64, device=device)
    return torch.tensor(list(value), dtype=torch.int64, device=device)


def _extended_targets(targets: torch.Tensor, target_lengths: torch.Tensor, n: int, blank: int,
                      num_classes: int) -> tuple[torch.Tensor, int]:
    """Each sample's targets with a blank before, between and after them (``(N, 2S + 1)``),
    and ``S``; padded 2-D targets keep their width, concatenated 1-D targets take their
    total length as the width (no sample's targets are longer)."""
    targets = targets.to(torch.int64)
    if targets.dim() == 2:
        padded = targets
    else:
        total = targets.shape[0]
        offsets = torch.cumsum(target_lengths, 0) - target_lengths
        steps = torch.arange(max(total, 1), device=targets.device)
        index = (offsets[:, None] + steps[None, :]).clamp(max=max(total - 1, 0))
        padded = targets[index] if total else torch.zeros((n, 1), dtype=torch.int64, device=targets.device)
    width = padded.shape[1]
    padded = padded.clamp(0, num_classes - 1)
    blanks = torch.full_like(padded, blank)
    interleaved = torch.stack([blanks, padded], 2).reshape(n, 2 * width)
    return torch.cat([interleaved, blanks[:, :1]], 1), width


def _logsumexp(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """log(sum(exp)) of same-shaped tensors of finite values (the max is a constant shift)."""
    top = terms[0]
    for t in terms[1:]:
        top = torch.maximum(top, t)
    top = top.detach()
    total = torch.exp(terms[0] - top)
    for t in terms[1:]:
        total = total + torch.exp(t - top)
    return top + torch.log(total)


def _ctc(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
         target_lengths: torch.Tensor, blank: int, zero_infinity: bool) -> torch.Tensor:
    """The per-sample negative log-likelihoods (``(N,)``) of ``log_probs`` (``(T, N, C)``)."""
    steps, n, num_classes = log_probs.shape
    device, dtype = log_probs.device, log_probs.dtype
    never = torch.finfo(dtype).min / 4  # log(0), finite (see the module docstring)
    extended, width = _extended_targets(targets, target_lengths, n, blank, num_classes)
    positions = 2 * width + 1
    # log-probability of each extended position's symbol at each step: (T, N, 2S + 1)
    emit = torch.gather(log_probs, 2, extended.unsqueeze(0).expand(steps, n, positions))
    # the skip s-2 -> s is allowed onto a label that differs from the label before it
    previous = torch.cat([torch.full((n, 2), blank, dtype=torch.int64, device=device), extended[:, :-2]], 1)
    skip = (extended != blank) & (extended != previous) & (torch.arange(positions, device=device) >= 2)[None, :]
    start = torch.arange(positions, device=device) < 2
    alpha = torch.where(start[None, :], emit[0], torch.full_like(emit[0], never))
    pad1 = torch.full((n, 1), never, dtype=dtype, device=device)
    pad2 = torch.full((n, 2), never, dtype=dtype, device=device)
    for t in range(1, steps):
        stay = alpha
        advance = torch.cat([pad1, alpha[:, :-1]], 1)
        jump = torch.where(skip, torch.cat([pad2, alpha[:, :-2]], 1), torch.full_like(alpha, never))
        new = _logsumexp([stay, advance, jump]) + emit[t]
        alpha = torch.where((t < input_lengths)[:, None], new, alpha)  # a sample's steps end at its length
    last = (2 * target_lengths).clamp(max=positions - 1)
    end_blank = torch.gather(alpha, 1, last[:, None])[:, 0]
    end_label = torch.gather(alpha, 1, (last - 1).clamp(min=0)[:, None])[:, 0]
    end_label = torch.where(target_lengths > 0, end_label, torch.full_like(end_label, never))
    log_likelihood = _logsumexp([end_blank, end_label])
    impossible = log_likelihood < never / 2
    # eager's gradient adds exp(log_probs) over each sample's steps (see the module docstring)
    valid = (torch.arange(steps, device=device)[:, None] < input_lengths[None, :]).to(dtype)
    mass = (torch.exp(log_probs).sum(2) * valid).sum(0)
    losses = -log_likelihood + (mass - mass.detach())
    infinite = torch.zeros_like(losses) if zero_infinity else torch.full_like(losses, float("inf"))
    return torch.where(impossible, infinite, losses)
