"""PopTorch's enums (``poptorch.enums``), with upstream's member names and values.

Every enum of PopTorch 3.x's ``python/enums.py`` is here and at PopTorch's top level
(``poptorch.ReductionType``...). ``OutputMode`` (with its pre-3.0 name ``AnchorMode``)
lives in :mod:`ipuxl.poptorch_compat.options` and ``DataLoaderMode`` in
:mod:`ipuxl.poptorch_compat.dataloader`; both are re-exported here, so
``poptorch.enums.OutputMode is poptorch.OutputMode`` (loaded on first use, as
``options`` imports this module).

Which options and APIs honour each value on the simulated device is listed in
``docs/poptorch.md``; values that select hardware behaviour (``SyncPattern``,
``Liveness``...) are accepted and recorded.
"""
from __future__ import annotations

import enum
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ipuxl.poptorch_compat.dataloader import DataLoaderMode
    from ipuxl.poptorch_compat.options import AnchorMode, OutputMode

__all__ = [
    "AnchorMode", "AutoStage", "CommGroupType", "ConnectionType", "DataLoaderMode", "HalfFloatCastingBehavior",
    "Liveness", "MatMulSerializationMode", "MeanReductionStrategy", "MultiConvPlanType", "OutputMode", "OverlapMode",
    "ReductionType", "SharingStrategy", "SyncPattern", "VariableRetrievalMode",
]


class MeanReductionStrategy(enum.IntEnum):
    """When a ``ReductionType.Mean`` gradient reduction divides by its count.

    - ``Running``: keep the accumulator as the running mean.
    - ``Post``: sum, then divide by accumulation x replication count at the end.
    - ``PostAndLoss``: divide by the replica count before the backward pass and by the
      accumulation count at the end (deprecated upstream).
    """

    Running = 0
    Post = 1
    PostAndLoss = 2


class SharingStrategy(enum.IntEnum):
    """How the data-loading worker processes share data (``AsynchronousDataAccessor``)."""

    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class ConnectionType(enum.IntEnum):
    """When to attach to the device: at once (``Always``), once compiled (``OnDemand``),
    or ``Never`` (compile only: running the model raises)."""

    Always = 0
    OnDemand = 1
    Never = 2


class HalfFloatCastingBehavior(enum.IntEnum):
    """Casting of ops mixing float16 and float32 inputs.

    - ``FloatDowncastToHalf``: every input is cast to float16.
    - ``HalfUpcastToFloat``: PyTorch's promotion rules (float16 -> float32).
    - ``Default``: ``HalfUpcastToFloat``, PyTorch's rules (ipuxl captures with the
      dispatcher, as PopTorch 3.x does).
    """

    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


class ReductionType(enum.IntEnum):
    """A reduction: ``Sum``, ``Mean`` or ``NoReduction``."""

    Sum = 0
    Mean = 1
    NoReduction = 2


class SyncPattern(enum.IntEnum):
    """How IPUs synchronise with each other and the host (hardware only)."""

    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class MatMulSerializationMode(enum.Enum):
    """The dimension ``poptorch.serializedMatMul`` splits a matrix product along."""

    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class Liveness(enum.IntEnum):
    """Where tensors live between the phases of a phased execution strategy."""

    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class OverlapMode(enum.Enum):
    """How host transfers of an input or output overlap compute (IO tiles)."""

    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


class AutoStage(enum.IntEnum):
    """How blocks without an explicit stage get one: the stage is the block's IPU
    (``SameAsIpu``) or the next stage number (``AutoIncrement``)."""

    SameAsIpu = 0
    AutoIncrement = 1


class MultiConvPlanType(enum.IntEnum):
    """How ``poptorch.MultiConv`` plans its convolutions: together or one by one."""

    Parallel = 0
    Serial = 1


class CommGroupType(enum.IntEnum):
    """How replicas are grouped for a grouped variable or input.

    - ``All``: one group of every replica.
    - ``Consecutive``: groups of consecutive replicas ``{0..k-1}, {k..2k-1}...``.
    - ``Orthogonal``: strided groups ``{0, m, 2m...}, {1, m+1...}`` (``m = N / k``).
    - ``NoGrouping``: each replica on its own.
    """

    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    """What reading a grouped variable returns: one value per group or per replica."""

    OnePerGroup = 0
    AllReplicas = 2


#: the enums defined next to the code that uses them: name -> module
_ELSEWHERE = {
    "OutputMode": "ipuxl.poptorch_compat.options",
    "AnchorMode": "ipuxl.poptorch_compat.options",
    "DataLoaderMode": "ipuxl.poptorch_compat.dataloader",
}


def __getattr__(name: str) -> Any:
    if name not in _ELSEWHERE:
        raise AttributeError(f"module 'ipuxl.poptorch_compat.enums' (poptorch.enums) has no attribute '{name}'")
    return getattr(importlib.import_module(_ELSEWHERE[name]), name)
