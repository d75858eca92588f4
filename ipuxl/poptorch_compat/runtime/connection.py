"""``Options.connectionType``: when a wrapped model holds its (simulated) device.

As upstream: ``Always`` and ``OnDemand`` attach when the model is compiled (the
simulated device needs no separate wait, so they behave the same); ``Never``
(also set by ``useOfflineIpuTarget``) compiles without ever attaching: ``compile``
works, ``isAttachedToDevice()`` stays False, and running or attaching the model
raises ``OfflineDeviceError`` (PopTorch fails an assertion there).
"""
from __future__ import annotations

from ipuxl.errors import OfflineDeviceError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.enums import ConnectionType
from ipuxl.poptorch_compat.options import Options

__all__ = ["attaches", "refuse_offline"]


def attaches(options: Options) -> bool:
    """Whether a model compiled with ``options`` attaches to its device (not ``Never``)."""
    return options.connection_type != ConnectionType.Never


def refuse_offline(options: Options, kind: str, action: str) -> None:
    """Raise when ``options`` name an offline device (``ConnectionType.Never``).

    Args:
        kind: "training" or "inference" (for the message).
        action: what was refused, e.g. "run" or "attach".

    Raises:
        OfflineDeviceError: ``connectionType(ConnectionType.Never)`` (or ``useOfflineIpuTarget``).
    """
    if attaches(options):
        return
    what = ("Trying to run a model on an offline device (ConnectionType.Never): use model.compile(inputs) "
            "instead of model(inputs)" if action == "run"
            else f"cannot {action} the {kind} model: it targets an offline device (ConnectionType.Never)")
    raise OfflineDeviceError(
        what,
        where=user_source_line(),
        fix="use model.compile(inputs) to compile without running, or build the model with options "
            "whose connectionType is ConnectionType.Always or OnDemand (no useOfflineIpuTarget)")
