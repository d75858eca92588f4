"""PopTorch's hardware queries, answered by ipuxl's simulated IPUs.

The simulated IPUs are the IPUs a PopTorch program gets on ipuxl, so they count as IPU
hardware: ``ipuHardwareIsAvailable(n)`` is True when the machine has at least ``n`` of
them, and ``ipuHardwareVersion()`` names their version (2, a Mk2 IPU, whose memory the
resource model uses). How many there are is ``IPUXL_NUM_IPUS`` (default 64, an
IPU-POD64); ``IPUXL_NUM_IPUS=0`` makes the machine answer as one without IPUs
(``ipuHardwareIsAvailable()`` False, ``ipuHardwareVersion()`` raises), for programs that
take another path there. The count is read at each call; nothing else limits the IPUs
a program uses. ``isRunningOnIpu`` tells a model's forward whether it runs on the
(simulated) IPU, i.e. is being captured for a ``trainingModel`` or ``inferenceModel``.
"""
from __future__ import annotations

import numbers
import os

from ipuxl.capture.mode import active_mode
from ipuxl.errors import InvalidArgumentError, InvalidValueError, NoIpuHardwareError
from ipuxl.ir.context import user_source_line

__all__ = ["ipuHardwareIsAvailable", "ipuHardwareVersion", "isRunningOnIpu", "num_simulated_ipus",
           "DEFAULT_NUM_IPUS", "IPU_VERSION", "hasMlirSupportOnPlatform"]

#: the simulated IPUs when ``IPUXL_NUM_IPUS`` is not set (an IPU-POD64)
DEFAULT_NUM_IPUS = 64
#: ``ipuHardwareVersion()`` of a simulated IPU: a Mk2 (GC200) IPU
IPU_VERSION = 2


def num_simulated_ipus() -> int:
    """The simulated IPUs of this machine: ``IPUXL_NUM_IPUS``, else ``DEFAULT_NUM_IPUS``.

    Raises:
        InvalidValueError: ``IPUXL_NUM_IPUS`` is not a whole number >= 0.
    """
    value = os.environ.get("IPUXL_NUM_IPUS", "").strip()
    if not value:
        return DEFAULT_NUM_IPUS
    if not value.isdigit():
        raise InvalidValueError(f"IPUXL_NUM_IPUS must be a whole number >= 0, got {value!r}",
                                where=user_source_line(),
                                fix="set IPUXL_NUM_IPUS=N for N simulated IPUs (0: no IPUs), or unset it")
    return int(value)

def hasMlirSupportOnPlatform() -> bool:  # noqa: N802 - PopTorch's name
    """Whether PopTorch's MLIR compiler is available here: never on ipuxl (it compiles
    through its own IR)."""
    return False



def isRunningOnIpu() -> bool:  # noqa: N802 - PopTorch's name
    """True inside a forward that ipuxl captures for the device (the IPU code path of
    ``if poptorch.isRunningOnIpu(): ... else: ...``), False when the model runs eagerly."""
    return active_mode() is not None


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:  # noqa: N802 - PopTorch's name
    """Whether the machine has at least ``num_ipus`` IPUs: the simulated ones
    (``IPUXL_NUM_IPUS``, default 64; 0 answers False)."""
    if isinstance(num_ipus, bool) or not isinstance(num_ipus, numbers.Integral):
        raise InvalidArgumentError(f"ipuHardwareIsAvailable: num_ipus must be an int, got {num_ipus!r}",
                                   where=user_source_line(), fix="pass a whole number, e.g. 1")
    count = num_simulated_ipus()
    return count > 0 and num_ipus <= count


def ipuHardwareVersion() -> int:  # noqa: N802 - PopTorch's name
    """The IPU version of the machine's IPUs: 2 (Mk2) for the simulated IPUs.

    Raises:
        NoIpuHardwareError: (an AssertionError, as upstream's failed assert) the machine
            has no IPUs (``IPUXL_NUM_IPUS=0``).
    """
    if num_simulated_ipus() == 0:
        raise NoIpuHardwareError("No IPU hardware available on this system (IPUXL_NUM_IPUS=0)",
                                 where=user_source_line(),
                                 fix="unset IPUXL_NUM_IPUS (or set it > 0) to use the simulated IPUs")
    return IPU_VERSION
