"""PopTorch's hardware queries: ipuxl's device is always simulated, so no IPU hardware
is ever present (``ipuHardwareIsAvailable`` is False, ``ipuHardwareVersion`` raises as
upstream does without hardware). ``isRunningOnIpu`` tells a model's forward whether it
runs on the (simulated) IPU, i.e. is being captured for a ``trainingModel`` or
``inferenceModel``."""
from __future__ import annotations

import numbers

from ipuxl.capture.mode import active_mode
from ipuxl.errors import InvalidArgumentError, NoIpuHardwareError
from ipuxl.ir.context import user_source_line

__all__ = ["ipuHardwareIsAvailable", "ipuHardwareVersion", "isRunningOnIpu", "hasMlirSupportOnPlatform"]


def hasMlirSupportOnPlatform() -> bool:  # noqa: N802 - PopTorch's name
    """Whether PopTorch's MLIR compiler is available here: never on ipuxl (it compiles
    through its own IR)."""
    return False


def isRunningOnIpu() -> bool:  # noqa: N802 - PopTorch's name
    """True inside a forward that ipuxl captures for the device (the IPU code path of
    ``if poptorch.isRunningOnIpu(): ... else: ...``), False when the model runs eagerly."""
    return active_mode() is not None


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:  # noqa: N802 - PopTorch's name
    """Whether IPU hardware with ``num_ipus`` IPUs is present: always False on ipuxl."""
    if isinstance(num_ipus, bool) or not isinstance(num_ipus, numbers.Integral):
        raise InvalidArgumentError(f"ipuHardwareIsAvailable: num_ipus must be an int, got {num_ipus!r}",
                                   where=user_source_line(), fix="pass a whole number, e.g. 1")
    return False


def ipuHardwareVersion() -> int:  # noqa: N802 - PopTorch's name
    """The IPU hardware version; like PopTorch on a machine without IPUs, raises.

    Raises:
        NoIpuHardwareError: always (an AssertionError, as upstream's failed assert).
    """
    raise NoIpuHardwareError("No IPU hardware available on this system: ipuxl simulates the IPU",
                             where=user_source_line(),
                             fix="check poptorch.ipuHardwareIsAvailable() first (always False on ipuxl)")
