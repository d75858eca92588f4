"""PopTorch's hardware queries, answered by ipuxl's simulated IPUs.

The simulated IPUs are the IPUs a PopTorch program gets on ipuxl, so they count as IPU
hardware: ``ipuHardwareIsAvailable(n)`` is True when the machine has at least ``n`` of
them, and ``ipuHardwareVersion()`` names their version (2, a Mk2 IPU, whose memory the
resource model uses). How many there are is ``IPUXL_NUM_IPUS`` (default 64, an
IPU-POD64); ``IPUXL_NUM_IPUS=0`` makes the machine answer as one without IPUs
(``ipuHardwareIsAvailable()`` False, ``ipuHardwareVersion()`` raises), for programs that
take another path there. The count is read at each call; a program that needs more IPUs
(replicas x IPUs per replica) is refused when compiled to attach, as upstream refuses it
(``check_ipu_count``: "Too many IPUs requested"). ``isRunningOnIpu`` tells a model's forward whether it runs on the
(simulated) IPU, i.e. is being captured for a ``trainingModel`` or ``inferenceModel``.
"""
from __future__ import annotations

import numbers

from ipuxl.capture.mode import active_mode
from ipuxl.device.device_info import DEFAULT_NUM_IPUS, num_simulated_ipus
from ipuxl.errors import DeviceError, InvalidArgumentError, InvalidValueError, NoIpuHardwareError
from ipuxl.ir.context import user_source_line

__all__ = ["ipuHardwareIsAvailable", "ipuHardwareVersion", "isRunningOnIpu", "num_simulated_ipus", "check_ipu_count",
           "DEFAULT_NUM_IPUS", "IPU_VERSION", "hasMlirSupportOnPlatform"]

#: ``ipuHardwareVersion()`` of a simulated IPU: a Mk2 (GC200) IPU
IPU_VERSION = 2


def check_ipu_count(requested: int) -> None:
    """Refuse a program that needs more IPUs than the machine has (upstream's "Too many IPUs
    requested (N)" when it acquires the device).

    Raises:
        DeviceError: (a ``poptorch.Error``) ``requested`` is above ``num_simulated_ipus()``.
    """
    available = num_simulated_ipus()
    if requested > available:
        raise DeviceError(f"Too many IPUs requested ({requested}). Experiments that need more than {available} IPUs "
                          f"cannot run on this machine: it has {available} simulated IPUs (IPUXL_NUM_IPUS).",
                          where=user_source_line(),
                          fix="lower replicationFactor (or the IPUs the blocks use), or set IPUXL_NUM_IPUS to at "
                              f"least {requested}")


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
