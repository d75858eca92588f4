"""What the PopTorch wrappers log about compiling (``ipuxl.log``, ``ipuxl.progress``).

``trainingModel``/``inferenceModel`` compile on the first call and recompile when a
call's inputs change (new shapes, other non-tensor arguments) or the optimiser changes
in a way its variables cannot hold; each recompile is logged at INFO with its reason.
"""
from __future__ import annotations

from typing import Sequence

from ipuxl.log import logger
from ipuxl.poptorch_compat.compile.batching import MicroBatch, describe

__all__ = ["log_recompile", "recompile_reason", "program_stages"]


def program_stages(training: bool, outline: bool) -> list[str]:
    """The stages of a wrapper's compile, in order: ``compile.compile_model``'s, then the
    Session's ``compile`` (lowering to code)."""
    return ["capture", *(["autodiff"] if training else []), *(["outline"] if outline else []), "compile"]


def recompile_reason(old: tuple | None, new: tuple, input_names: Sequence[str] = ()) -> str:
    """Why a call with compile key ``new`` does not run the program compiled for ``old``
    (keys: ``batching.SplitBatch.micro``), e.g. ``input 'x' shape changed from [8, 4] to [16, 4]``.

    Args:
        input_names: the traced names of the key's tensor leaves, in order.
    """
    if old is None:
        return "first call"
    (old_leaves, old_spec), (new_leaves, new_spec) = old, new
    if old_spec != new_spec or len(old_leaves) != len(new_leaves):
        return f"the call's arguments changed from ({describe(old)}) to ({describe(new)})"
    names = iter(input_names)
    changes = []
    for position, (was, now) in enumerate(zip(old_leaves, new_leaves)):
        if isinstance(was, MicroBatch):
            name = next(names, f"#{position}")
            if isinstance(now, MicroBatch) and was.shape != now.shape:
                changes.append(f"input '{name}' shape changed from {list(was.shape)} to {list(now.shape)} "
                               "(per micro-batch)")
            elif isinstance(now, MicroBatch) and was.dtype != now.dtype:
                changes.append(f"input '{name}' dtype changed from {was.dtype} to {now.dtype}")
            elif not isinstance(now, MicroBatch):
                changes.append(f"input '{name}' changed from a tensor to {now!r}")
        elif was != now:
            changes.append(f"argument {position} changed from {was!r} to {now!r}")
    return "; ".join(changes) or f"the call changed from ({describe(old)}) to ({describe(new)})"


def log_recompile(kind: str, reason: str) -> None:
    """Log (INFO) that the ``kind`` (training/inference) model recompiles, and why."""
    logger.info("recompiling the %s model: %s", kind, reason)
