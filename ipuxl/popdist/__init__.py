"""PopDist (``import popdist``): where this instance stands in a multi-instance program.

Graphcore's PopDist answers from the environment PopRun gives each instance. ipuxl's
programs are launched as several instances by torchrun, so the answers come from
torchrun's environment, and from one process when there is none:

==========================  =================================================  ===========
query                       under torchrun                                     one process
==========================  =================================================  ===========
``isPopdistEnvSet``         True                                               False
``getNumInstances``         ``WORLD_SIZE``                                     1
``getInstanceIndex``        ``RANK``                                           0
``getLocalInstanceIndex``   ``LOCAL_RANK``                                     0
``getNumLocalReplicas``     ``POPDIST_NUM_LOCAL_REPLICAS``, else 1             1
``getNumTotalReplicas``     ``POPDIST_NUM_TOTAL_REPLICAS``, else local x n     1
``getReplicaIndexOffset``   ``POPDIST_REPLICA_INDEX_OFFSET``, else index x local  0
``getNumIpusPerReplica``    ``POPDIST_NUM_IPUS_PER_REPLICA``, else 1           1
==========================  =================================================  ===========

(PopRun's ``POPDIST_*`` variables, when set, take precedence, as upstream reads them.)
A program built with ``popxl.Ir(replication="popdist")`` has ``getNumTotalReplicas()``
replicas, of which each instance runs its ``getNumLocalReplicas()`` consecutive ones.

Calls that only mean something with several instances (``initializeBackend``,
``popdist.popart.configureSessionOptions``, ``popdist.poptorch.Options``) raise
``PopdistError`` (a RuntimeError) when no launcher set the environment, where upstream
fails without PopRun's.

Submodules, as upstream: ``popdist.popart`` (PopART session options, which PopXL's
``Ir(replication="popdist")`` uses) and ``popdist.poptorch`` (``Options``).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable

from ipuxl.errors import InvalidValueError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.world import local_replicas, total_replicas, world
from ipuxl.popdist.launch import LAUNCH_FIX, is_launched, require_launch

__all__ = [
    "isPopdistEnvSet", "getNumInstances", "getInstanceIndex", "getLocalInstanceIndex", "getNumLocalReplicas",
    "getNumTotalReplicas", "getReplicaIndexOffset", "getNumIpusPerReplica", "checkNumIpusPerReplica", "getDeviceId",
    "execute_on_instances", "initializeBackend", "isBackendInitialized", "finalizeBackend",
]

def isPopdistEnvSet() -> bool:  # noqa: N802 - PopDist's names
    """Whether a launcher set the multi-instance environment (torchrun, or PopRun's variables)."""
    return is_launched()


def getNumInstances() -> int:  # noqa: N802
    """The number of instances (processes) running the program."""
    return world()[0]


def getInstanceIndex() -> int:  # noqa: N802
    """This instance's index, in ``[0, getNumInstances())``."""
    return world()[1]


def getLocalInstanceIndex() -> int:  # noqa: N802
    """This instance's index among the instances of its host (0 when not set)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("POPDIST_LOCAL_INSTANCE_INDEX", "0")))


def getNumLocalReplicas() -> int:  # noqa: N802
    """The replicas this instance runs."""
    return local_replicas()


def getNumTotalReplicas() -> int:  # noqa: N802
    """The replicas of the whole program."""
    return total_replicas()


def getReplicaIndexOffset() -> int:  # noqa: N802
    """The global index of this instance's first replica."""
    offset = os.environ.get("POPDIST_REPLICA_INDEX_OFFSET")
    return int(offset) if offset else getInstanceIndex() * getNumLocalReplicas()


def getNumIpusPerReplica() -> int:  # noqa: N802
    """The IPUs each replica uses (``POPDIST_NUM_IPUS_PER_REPLICA``; 1 when not set)."""
    return int(os.environ.get("POPDIST_NUM_IPUS_PER_REPLICA", "1"))


def checkNumIpusPerReplica(ipus_per_replica: int) -> bool:  # noqa: N802
    """Whether ``ipus_per_replica`` is the environment's IPUs per replica (True when it sets none)."""
    value = os.environ.get("POPDIST_NUM_IPUS_PER_REPLICA")
    return value is None or int(value) == int(ipus_per_replica)


def getDeviceId(ipusPerReplica: int = 0) -> int:  # noqa: N802,N803
    """The id of this instance's device: its index on its host (each instance of a host
    drives its own device, as each torchrun process its own accelerator)."""
    return getLocalInstanceIndex()


def execute_on_instances(instances: Iterable[int], func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` on the instances in ``instances`` only (None on the others).

    Raises:
        InvalidValueError: (a ValueError) an instance index outside ``[0, getNumInstances())``.
    """
    chosen = set(instances)
    count = getNumInstances()
    outside = sorted(i for i in chosen if not 0 <= i < count)
    if outside:
        raise InvalidValueError(f"execute_on_instances: instances {outside} do not exist; the program runs "
                                f"{count} instance(s)", where=user_source_line(),
                                fix=f"choose instances in [0, {count})" + ("" if count > 1 else f"; {LAUNCH_FIX}"))
    return func(*args, **kwargs) if getInstanceIndex() in chosen else None


def isBackendInitialized() -> bool:  # noqa: N802
    """Whether the instances' communication backend (torch.distributed) is initialised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def initializeBackend() -> None:  # noqa: N802
    """Join the instances' communication backend (torch.distributed: gloo, or NCCL on CUDA).

    Raises:
        PopdistError: not launched as several instances.
    """
    require_launch("initializeBackend")
    if not isBackendInitialized():
        import torch
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def finalizeBackend() -> None:  # noqa: N802
    """Leave the communication backend (no effect when not initialised)."""
    if isBackendInitialized():
        import torch.distributed as dist

        dist.destroy_process_group()
