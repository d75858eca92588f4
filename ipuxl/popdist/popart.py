"""``popdist.popart``: PopART session options for a multi-instance program.

PopXL's ``Ir(replication="popdist")`` calls ``configureSessionOptions`` on its PopART
options (``ir._pb_ir.getSessionOptions()``); ipuxl's ``Ir`` takes the same counts from
``ipuxl.ir.world``, so calling it yourself only records them on the options object.
"""
from __future__ import annotations

from typing import Any

from ipuxl.popdist import (
    getNumInstances, getNumLocalReplicas, getNumTotalReplicas, getReplicaIndexOffset,
)
from ipuxl.popdist.launch import require_launch

__all__ = ["configureSessionOptions"]


def configureSessionOptions(opts: Any) -> None:  # noqa: N802 - PopDist's name
    """Set the distributed replication fields of PopART ``SessionOptions`` ``opts``:
    ``enableReplicatedGraphs``/``replicatedGraphCount`` (this instance's replicas),
    ``enableDistributedReplicatedGraphs``, ``globalReplicaOffset`` and
    ``globalReplicationFactor``.

    Raises:
        PopdistError: (a RuntimeError) not launched as several instances.
    """
    require_launch("popart.configureSessionOptions")
    local = getNumLocalReplicas()
    opts.enableReplicatedGraphs = local > 1
    opts.replicatedGraphCount = local
    opts.enableDistributedReplicatedGraphs = getNumInstances() > 1
    opts.globalReplicaOffset = getReplicaIndexOffset()
    opts.globalReplicationFactor = getNumTotalReplicas()
