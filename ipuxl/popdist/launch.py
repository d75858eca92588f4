"""Whether a launcher set the multi-instance environment, and the error when one is needed."""
from __future__ import annotations

import os

from ipuxl.errors import PopdistError
from ipuxl.ir.context import user_source_line

__all__ = ["is_launched", "require_launch", "LAUNCH_FIX"]

LAUNCH_FIX = ("launch the program with torchrun (torchrun --nproc_per_node N -m ipuxl.compat PROGRAM.py), "
              "or guard the call with popdist.isPopdistEnvSet()")


def is_launched() -> bool:
    """torchrun's ``WORLD_SIZE`` and ``RANK``, or PopRun's ``POPDIST_NUM_TOTAL_REPLICAS``, are set."""
    return ("WORLD_SIZE" in os.environ and "RANK" in os.environ) or "POPDIST_NUM_TOTAL_REPLICAS" in os.environ


def require_launch(what: str) -> None:
    """Raise ``PopdistError`` naming ``popdist.<what>`` unless a launcher set the environment."""
    if not is_launched():
        raise PopdistError(f"popdist.{what} needs a multi-instance launch, and none set the environment "
                           "(no WORLD_SIZE/RANK from torchrun, no POPDIST_* variables)", where=user_source_line(),
                           fix=LAUNCH_FIX)
