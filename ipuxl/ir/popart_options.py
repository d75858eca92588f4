"""The few PopART session options PopXL programs set through ``ir._pb_ir``.

PopXL programs reach past PopXL into its PopART IR for options PopXL does not wrap,
e.g. the phased-execution tutorial's
``ir._pb_ir.getSessionOptions().numIOTiles = 32`` before batch serialising with IO
tiles, or Graphcore's applications' ``enableStochasticRounding``, ``partialsTypeMatMuls``
and Poplar ``engineOptions``. ``Ir._pb_ir`` answers with this stand-in so such programs
run. The options are recorded and have no effect: the simulated device has no IO tiles
(IO-tile code runs on the compute tiles, with the same values), rounds to nearest and
accumulates matmuls in the output dtype (float32 partials for float32). As PopART, an
option it does not have is an AttributeError. Two are honoured: ``enableFloatingPointChecks``
(or the engine option ``debug.floatPointOpException``) checks the IPU's floating-point
exceptions around each op, and ``throwIfLog2ScaleTensorNotInRange`` stops a run whose float8
scale is out of range (``ipuxl.device.fp_checks``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SessionOptions", "PopartIr"]


@dataclass(slots=True)
class SessionOptions:
    """PopART ``SessionOptions`` fields PopXL programs set (recorded, no effect)."""

    numIOTiles: int = 0  # noqa: N815 - PopART's name
    enableExplicitMainLoops: bool = True  # noqa: N815
    useHostCopyOps: bool = True  # noqa: N815
    # numerics and code shape on an IPU (recorded: the simulated device computes in the
    # tensors' own dtypes, with round-to-nearest, and compiles each graph once)
    enableStochasticRounding: bool = False  # noqa: N815
    partialsTypeMatMuls: str = ""  # noqa: N815
    enableStableNorm: bool = False  # noqa: N815
    enableInplaceAmbiguityChecking: bool = True  # noqa: N815
    constantWeights: bool = True  # noqa: N815
    aliasZeroCopy: bool = True  # noqa: N815
    explicitRecomputation: bool = True  # noqa: N815
    virtualGraphMode: int = 0  # noqa: N815 - popart.VirtualGraphMode (0: Off); PopXL places ops with popxl.ipu
    enableOutlining: bool = True  # noqa: N815
    outlineThreshold: float = 1.0  # noqa: N815
    enableEngineCaching: bool = False  # noqa: N815
    # honoured: the IPU's floating-point exceptions, checked around each op (device.fp_checks)
    enableFloatingPointChecks: bool = False  # noqa: N815
    # honoured: a float8 scale outside [-32, 32) stops the run (else it is clipped)
    throwIfLog2ScaleTensorNotInRange: bool = True  # noqa: N815
    cachePath: str = "session_cache"  # noqa: N815
    engineOptions: dict[str, str] = field(default_factory=dict)  # noqa: N815 - Poplar engine options
    reportOptions: dict[str, str] = field(default_factory=dict)  # noqa: N815
    # replication, as popdist.popart.configureSessionOptions sets it
    enableReplicatedGraphs: bool = False  # noqa: N815
    replicatedGraphCount: int = 1  # noqa: N815
    enableDistributedReplicatedGraphs: bool = False  # noqa: N815
    globalReplicaOffset: int = 0  # noqa: N815
    globalReplicationFactor: int = 1  # noqa: N815


@dataclass
class PopartIr:
    """What ``ir._pb_ir`` offers: ``getSessionOptions()``."""

    options: SessionOptions = field(default_factory=SessionOptions)

    def getSessionOptions(self) -> SessionOptions:  # noqa: N802 - PopART's name
        return self.options
