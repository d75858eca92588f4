"""``popdist.poptorch``: PopTorch ``Options`` for one instance of a multi-instance program."""
from __future__ import annotations

from typing import Any

from ipuxl.errors import PopdistError
from ipuxl.ir.context import user_source_line
from ipuxl.popdist import (
    checkNumIpusPerReplica, getInstanceIndex, getNumInstances, getNumIpusPerReplica, getNumLocalReplicas,
)
from ipuxl.popdist.launch import require_launch
from ipuxl.poptorch_compat.options import Options as _PoptorchOptions

__all__ = ["Options"]


class Options(_PoptorchOptions):
    """``poptorch.Options`` set up for this instance: the program's replicas and this
    process's place among the instances (``Distributed.configureProcessId``).

    Args:
        ipus_per_replica: the IPUs each replica uses (default: ``popdist.getNumIpusPerReplica()``).
        **kwargs: passed to ``poptorch.Options``.


    Raises:
        PopdistError: (a RuntimeError) not launched as several instances, or
            ``ipus_per_replica`` is not the environment's IPUs per replica.
    """

    def __init__(self, ipus_per_replica: int | None = None, **kwargs: Any):
        require_launch("poptorch.Options")
        super().__init__(**kwargs)
        ipus = getNumIpusPerReplica() if ipus_per_replica is None else ipus_per_replica
        if not checkNumIpusPerReplica(ipus):
            raise PopdistError(f"popdist.poptorch.Options: ipus_per_replica={ipus} but the launch gives each replica "
                               f"{getNumIpusPerReplica()} IPU(s)", where=user_source_line(),
                               fix="pass the launch's IPUs per replica, or omit ipus_per_replica")
        self.replicationFactor(getNumLocalReplicas())
        self.Distributed.configureProcessId(getInstanceIndex(), getNumInstances())
