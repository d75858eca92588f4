"""What a kernel raises to stop the device program on a value it computed, as Poplar's
assertions and floating-point exceptions do: the session reports it as an
``errors.ApplicationRuntimeError`` (``device.failures``)."""
from __future__ import annotations

__all__ = ["ProgramStop"]


class ProgramStop(Exception):
    """Base of the kernels' stops; each is raised with a built-in type beside it
    (``FloatingPointError``, ``ValueError``), which the session's error keeps."""
