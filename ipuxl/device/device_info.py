"""PopART's devices: ``popart.DeviceManager`` and the ``DeviceInfo`` objects it hands out.

A PopXL ``Session`` runs on a ``DeviceInfo``: one it makes from ``"cpu"``, ``"ipu_model"``
or ``"ipu_hw"``, or one the program acquired itself (``popart.DeviceManager()
.acquireAvailableDevice(...)``, ``createIpuModelDevice({...})``) and passed as the
session's ``device_desc``. The session is attached while its device is. A session made
from ``"ipu_hw"`` gets a hardware device of its own that takes no IPUs from the manager's
pool (several sessions, PopTorch's models among them, stay attached side by side).

Here every device is simulated: an ``Ipu`` device is a group of the machine's simulated
IPUs (``IPUXL_NUM_IPUS``, default 64, as PopTorch's ``ipuHardwareIsAvailable`` counts
them), ``IpuModel``, ``Sim`` and ``Cpu`` devices are made on request. What stays
PopART's: the device types and ids, the number of IPUs (a power of two for hardware),
``acquireAvailableDevice``'s refusal of ``DeviceConnectionType.Never``, a device that is
not attached until ``attach()`` (or acquired with ``DeviceConnectionType.Always``), and
IPUs that one attached device holds at a time within this process (another
``acquireAvailableDevice`` with ``Always`` picks free IPUs, or returns None).
"""
from __future__ import annotations

import math
import os
import random
from enum import IntEnum
from typing import Any, Mapping

from ipuxl.errors import DeviceError, InvalidValueError, PopartException
from ipuxl.ir.context import user_source_line

__all__ = ["DeviceType", "DeviceSelectionCriterion", "DeviceInfo", "DeviceManager", "device_info_for",
           "ipus_for", "session_device", "attach", "num_simulated_ipus", "DEFAULT_NUM_IPUS", "DeviceConnectionType",
           "SyncPattern"]

#: the simulated IPUs when ``IPUXL_NUM_IPUS`` is not set (an IPU-POD64)
DEFAULT_NUM_IPUS = 64
#: tiles per IPU of a Mk2 GC200 (``createIpuModelDevice``'s default)
TILES_PER_IPU = 1472


class DeviceConnectionType(IntEnum):
    """When a device connects: at once, when a session needs it, or never (an offline device)."""
    Always = 0
    OnDemand = 1
    Never = 2


class SyncPattern(IntEnum):
    """PopART's IPU synchronisation pattern (recorded; the simulated IPUs do not sync)."""
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class DeviceType(IntEnum):
    """PopART's ``DeviceType`` (``popart/devicemanager.hpp``)."""
    IpuModel = 0
    Cpu = 1
    Ipu = 2
    OfflineIpu = 3
    Sim = 4


class DeviceSelectionCriterion(IntEnum):
    """Which free device ``acquireAvailableDevice`` picks: the first, or one at random."""
    First = 0
    Random = 1


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


class DeviceInfo:
    """One device: its type, id, IPUs and tiles, and whether this process is attached to it.

    Usable as a context manager, as PopART's: leaving the ``with`` block detaches it.
    """

    def __init__(self, manager: "DeviceManager", type: DeviceType, num_ipus: int, tiles_per_ipu: int,  # noqa: A002
                 connection_type: DeviceConnectionType = DeviceConnectionType.Always, id: int = 0,  # noqa: A002
                 ipus: range = range(0)):
        self._manager = manager
        self._type = type
        self._num_ipus = num_ipus
        self._tiles = tiles_per_ipu
        self._connection = connection_type
        self._id = id
        self._ipus = ipus  # the simulated IPUs it holds while attached (none: it holds none)
        self._attached = False

    # PopART's read-only properties
    type = property(lambda self: self._type)
    connectionType = property(lambda self: self._connection)  # noqa: N815 - PopART's names
    id = property(lambda self: self._id)
    numIpus = property(lambda self: self._num_ipus)  # noqa: N815
    tilesPerIPU = property(lambda self: self._tiles)  # noqa: N815
    tilesPerIpu = property(lambda self: self._tiles)  # noqa: N815
    version = property(lambda self: "ipu2")
    driverIds = property(lambda self: list(self._ipus))  # noqa: N815
    numWorkerContexts = property(lambda self: 6)  # noqa: N815 - a Mk2 tile's worker threads

    @property
    def isAttached(self) -> bool:  # noqa: N802
        return self._attached

    def attach(self) -> bool:
        """Attach; False when another attached device of this process holds one of its IPUs
        (PopART's ``attach`` does not block either). An offline device cannot attach."""
        if self._attached:
            return True
        if self._type == DeviceType.OfflineIpu or self._manager._busy(self._ipus):
            return False
        self._attached = True
        self._manager._hold(self)
        return True

    def tryAttachUntilTimeout(self) -> bool:  # noqa: N802
        """``attach``: a simulated device is free or held by this process, so waiting cannot help."""
        return self.attach()

    def detach(self) -> None:
        if self._attached:
            self._attached = False
            self._manager._release(self)

    def __enter__(self) -> "DeviceInfo":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        return (f"Device Type:{self._type.name} Connection Type:{self._connection.name} Id:{self._id} "
                f"Version:{self.version} NumIPUs:{self._num_ipus} NumTilesPerIPU:{self._tiles}")


class DeviceManager:
    """PopART's device manager (one per process: every ``DeviceManager()`` shares its state)."""

    _held: dict[int, DeviceInfo] = {}  # simulated IPU -> the attached device holding it
    _attach_timeout = 0

    # -- internal bookkeeping of the IPUs attached devices hold --
    def _busy(self, ipus: range) -> bool:
        return any(i in DeviceManager._held for i in ipus)

    def _hold(self, device: DeviceInfo) -> None:
        DeviceManager._held.update((i, device) for i in device._ipus)

    def _release(self, device: DeviceInfo) -> None:
        for i in device._ipus:
            DeviceManager._held.pop(i, None)

    # -- PopART's methods --
    def setOnDemandAttachTimeout(self, attachTimeout: int) -> None:  # noqa: N802, N803
        DeviceManager._attach_timeout = int(attachTimeout)

    def enumerateDevices(self, pattern: SyncPattern = SyncPattern.Full, numIpus: int = 1,  # noqa: N802, N803
                         deviceType: DeviceType = DeviceType.Ipu,  # noqa: N803
                         connectionType: DeviceConnectionType = DeviceConnectionType.Always,  # noqa: N803
                         tilesPerIPU: int = 0) -> list[DeviceInfo]:  # noqa: N803
        """The hardware devices of ``numIpus`` IPUs each: the machine's simulated IPUs in aligned
        groups. Ids as on an IPU-POD: the single IPUs first, then the pairs, the fours..."""
        if deviceType != DeviceType.Ipu:
            return []
        total = num_simulated_ipus()
        if numIpus < 1 or numIpus > total or numIpus & (numIpus - 1):
            return []
        first_id = sum(total // size for size in _powers_of_two_below(numIpus))
        return [DeviceInfo(self, DeviceType.Ipu, numIpus, tilesPerIPU or TILES_PER_IPU, connectionType,
                           id=first_id + k, ipus=range(k * numIpus, (k + 1) * numIpus)) for k in range(total // numIpus)]

    def acquireAvailableDevice(self, numIpus: int = 1, tilesPerIpu: int = 0,  # noqa: N802, N803
                               pattern: SyncPattern = SyncPattern.Full,
                               connectionType: DeviceConnectionType = DeviceConnectionType.Always,  # noqa: N803
                               selectionCriterion: DeviceSelectionCriterion = DeviceSelectionCriterion.First  # noqa: N803
                               ) -> DeviceInfo | None:
        """A hardware device of ``numIpus`` IPUs (a power of two), attached when ``connectionType``
        is ``Always``; None when there is none free."""
        if numIpus > 0 and numIpus & (numIpus - 1):
            raise PopartException(f"You have attempted to acquire {numIpus} IPUs. The number of IPUs requested "
                                  "must be a power of two", fix="ask for 1, 2, 4, 8... IPUs")
        if connectionType == DeviceConnectionType.Never:
            raise PopartException("Trying to acquire a hardware device when connectionType is "
                                  "DeviceConnectionType::Never",
                                  fix="use createOfflineIPUDevice for a device that never connects")
        devices = self.enumerateDevices(pattern, numIpus, DeviceType.Ipu, connectionType, tilesPerIpu)
        if selectionCriterion == DeviceSelectionCriterion.Random:
            random.Random(1).shuffle(devices)
        for device in devices:
            if connectionType != DeviceConnectionType.Always:
                return device
            if device.attach():
                return device
        return None

    def acquireDeviceById(self, id: int, pattern: SyncPattern = SyncPattern.Full,  # noqa: N802, A002
                          connectionType: DeviceConnectionType = DeviceConnectionType.Always  # noqa: N803
                          ) -> DeviceInfo | None:
        """The hardware device with this id (see ``enumerateDevices``), attached when
        ``connectionType`` is ``Always``; None when there is no such device or it is busy."""
        total = num_simulated_ipus()
        for size in _powers_of_two_below(total * 2):
            for device in self.enumerateDevices(pattern, size, DeviceType.Ipu, connectionType):
                if device.id == id:
                    return device if connectionType != DeviceConnectionType.Always or device.attach() else None
        return None

    def createCpuDevice(self) -> DeviceInfo:  # noqa: N802
        return DeviceInfo(self, DeviceType.Cpu, 1, 1)

    def createIpuModelDevice(self, opts: Mapping[str, Any] | None = None) -> DeviceInfo:  # noqa: N802
        return self._simulated(DeviceType.IpuModel, opts)

    def createSimDevice(self, opts: Mapping[str, Any] | None = None) -> DeviceInfo:  # noqa: N802
        return self._simulated(DeviceType.Sim, opts)

    def createOfflineIPUDevice(self, opts: Mapping[str, Any]) -> DeviceInfo:  # noqa: N802
        """A device to compile for without attaching (``attach`` answers False)."""
        return self._simulated(DeviceType.OfflineIpu, opts, DeviceConnectionType.Never)

    def _simulated(self, kind: DeviceType, opts: Mapping[str, Any] | None,
                   connection: DeviceConnectionType = DeviceConnectionType.Always) -> DeviceInfo:
        opts = dict(opts or {})
        num_ipus = int(opts.get("numIPUs", 1))
        tiles = opts.get("tilesPerIPU")
        return DeviceInfo(self, kind, num_ipus, int(tiles) if tiles else TILES_PER_IPU, connection)


def _powers_of_two_below(n: int) -> list[int]:
    return [1 << k for k in range(max(0, math.ceil(math.log2(n)))) if (1 << k) < n] if n > 1 else []


def ipus_for(ipus_per_replica: int, replicas: int) -> int:
    """The IPUs a PopXL session acquires: ``ipus_per_replica * replicas`` rounded up to a power of two."""
    return 1 << max(0, math.ceil(math.log2(max(1, ipus_per_replica * replicas))))


def device_info_for(device_desc: str, num_ipus: int) -> DeviceInfo:
    """The device a session makes from its ``device_desc`` string, as PopXL's
    ``_to_device_info``: ``"ipu_hw"`` a hardware device acquired on demand (not attached until the
    session is entered), ``"ipu_model"`` an IPU Model, ``"cpu"`` a CPU device."""
    manager = DeviceManager()
    if device_desc == "cpu":
        return manager.createCpuDevice()
    if device_desc == "ipu_model":
        return manager.createIpuModelDevice({"numIPUs": num_ipus})
    # it holds none of the manager's IPUs: sessions (PopTorch's models among them) attach side by side,
    # and a program may use more IPUs than the machine simulates
    return DeviceInfo(manager, DeviceType.Ipu, num_ipus, TILES_PER_IPU, DeviceConnectionType.OnDemand)


_KINDS = {DeviceType.Cpu: "cpu", DeviceType.IpuModel: "ipu_model", DeviceType.Sim: "ipu_model",
          DeviceType.Ipu: "ipu_hw", DeviceType.OfflineIpu: "ipu_hw"}


def session_device(device_desc: "str | DeviceInfo", ipus_per_replica: int, replicas: int) -> tuple[DeviceInfo, str]:
    """A session's device and the kind it runs as (``"cpu"``, ``"ipu_model"``, ``"ipu_hw"``).

    Raises:
        InvalidValueError: a device of the user's with fewer IPUs than the program needs.
    """
    needed = ipus_for(ipus_per_replica, replicas)
    if not isinstance(device_desc, DeviceInfo):
        return device_info_for(device_desc, needed), device_desc
    if device_desc.type != DeviceType.Cpu and device_desc.numIpus < needed:
        raise InvalidValueError(f"the session's device has {device_desc.numIpus} IPU(s) but the program needs "
                                f"{needed} ({ipus_per_replica} per replica x {replicas} replica(s), rounded up to "
                                "a power of two)",
                                fix=f"acquire a device of {needed} IPUs, or lower ir.replication_factor")
    return device_desc, _KINDS[device_desc.type]


def attach(device: DeviceInfo, num_ipus: int) -> DeviceInfo:
    """Attach to ``device`` as a session entering its context does; an offline device is replaced
    by a hardware device of as many IPUs (the returned one).

    Raises:
        DeviceError: the device's IPUs are held by another attached device of this process.
    """
    if device.type == DeviceType.OfflineIpu:
        device = device_info_for("ipu_hw", num_ipus)
    if not device.attach():
        raise DeviceError(f"Could not attach to device {device.id}: its IPUs are held by another attached "
                              "device of this process", fix="detach the other device (leave its `with` block, or "
                              "call its detach()) first")
    return device
