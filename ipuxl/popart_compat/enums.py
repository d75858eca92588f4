"""PopART's session-option enums, as PopTorch programs pass them (``opts._Popart.set(key, int(popart.X.Y))``).

Members and values are PopART's (``popart/sessionoptions.hpp``, ``op/loss.hpp``,
``tensorlocation.hpp``, SDK 3.3); each is an ``IntEnum`` (pybind11's enums also convert
with ``int()`` and have ``name``/``value``). The ``N`` member PopART's C++ enums end with
(a count, not a choice) is left out. ipuxl records the options they set
(``Options._Popart``); they do not change what the simulated device computes.
"""
from __future__ import annotations

from enum import IntEnum

from ipuxl.device.device_info import DeviceConnectionType, SyncPattern  # the device enums live with the devices

__all__ = [
    "AccumulateOuterFragmentSchedule", "BatchSerializationBatchSchedule", "BatchSerializationMethod",
    "BatchSerializationTransformContext", "DeviceConnectionType", "ExecutionPhaseIOSchedule", "ExecutionPhaseSchedule",
    "GradientTensorTrackingMethod", "Instrumentation", "IrSerializationFormat", "MeanReductionStrategy",
    "MergeVarUpdateType", "RecomputationType", "ReductionType", "ReplicatedTensorSharding", "SubgraphCopyingStrategy",
    "SyncPattern", "SyntheticDataMode", "TensorStorage", "TileSet", "VirtualGraphMode", "DataType",
]


class GradientTensorTrackingMethod(IntEnum):
    AllNonViewChangingGradientTensors = 0
    ConvAndMatmulGradients = 1
    GradientsOfUserSpecifiedTensors = 2


#: PopART's ``RecomputationType`` and ``MergeVarUpdateType`` have a member named ``None``
#: (a keyword: programs write ``getattr(popart.RecomputationType, "None")``), so they are
#: built with the functional API.
RecomputationType = IntEnum("RecomputationType", [("None", 0), ("Standard", 1), ("NormOnly", 2), ("Pipeline", 3),
                                                  ("RecomputeAll", 4)], module=__name__)
MergeVarUpdateType = IntEnum("MergeVarUpdateType", [("None", 0), ("All", 1), ("AutoLoose", 2), ("AutoTight", 3)],
                             module=__name__)


class VirtualGraphMode(IntEnum):
    Off = 0
    Manual = 1
    Auto = 2
    ExecutionPhases = 3


class IrSerializationFormat(IntEnum):
    JSON = 0


class SyntheticDataMode(IntEnum):
    Off = 0
    Zeros = 1
    RandomNormal = 2


class Instrumentation(IntEnum):
    Outer = 0
    Inner = 1


class BatchSerializationBatchSchedule(IntEnum):
    Scheduler = 0
    Isomorphic = 1
    OverlapOnIo = 2
    OverlapOnCompute = 3


class BatchSerializationTransformContext(IntEnum):
    Fwd = 0
    Bwd = 1


class BatchSerializationMethod(IntEnum):
    UnrollDynamic = 0
    UnrollStatic = 1
    Loop = 2


class ExecutionPhaseIOSchedule(IntEnum):
    Preload = 0
    OnDemand = 1


class ExecutionPhaseSchedule(IntEnum):
    Interleaving = 0
    Batch = 1
    BatchClusteredIO = 2


class AccumulateOuterFragmentSchedule(IntEnum):
    Scheduler = 0
    Serial = 1
    OverlapCycleOptimized = 2
    OverlapMemoryOptimized = 3


class SubgraphCopyingStrategy(IntEnum):
    OnEnterAndExit = 0
    JustInTime = 1


class ReductionType(IntEnum):
    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(IntEnum):
    Running = 0
    Post = 1
    PostAndLoss = 2


class TensorStorage(IntEnum):
    OnChip = 0
    OffChip = 1


class ReplicatedTensorSharding(IntEnum):
    Off = 0
    On = 1


class TileSet(IntEnum):
    Compute = 0
    IO = 1


class DataType(IntEnum):
    """PopART's tensor element types (``popart/datatype.hpp``; programs name them, e.g. to pick
    a float8 format: ``popart.DataType.FLOAT8_143`` is ``popxl.float8_143``)."""
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    INT32 = 4
    INT64 = 5
    UINT32 = 6
    UINT64 = 7
    BOOL = 8
    FLOAT = 9
    FLOAT16 = 10
    BFLOAT16 = 11
    FLOAT8_143 = 12
    FLOAT8_152 = 13
    DOUBLE = 14
    COMPLEX64 = 15
    COMPLEX128 = 16
    STRING = 17
    UNDEFINED = 18
