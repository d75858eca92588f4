"""The PopART names Graphcore's PopXL and PopTorch programs use (``import popart``).

Programs written for PopXL import ``popart`` for its version string (which they log)
and PopART's ``SessionOptions`` fields they set through ``ir._pb_ir``. PopTorch
programs import it for the enums they pass to ``poptorch.Options._Popart.set``
(``int(popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized)``...) and for
``popart.SessionOptions`` settings; those are here (``enums``: PopART's members and
values), and its ``DeviceManager`` (simulated devices a PopXL ``Session`` can run on:
``ipuxl.device.device_info``). PopART's graph-building and session API (``Builder``,
``TrainingSession``, ``InferenceSession``...) is not: ipuxl builds graphs with PopXL's. Reading one of its names
raises ``CompatImportError`` (a ModuleNotFoundError) naming it, and ``popart._internal``
(PopART's C++ IR, which some programs and tests inspect directly) cannot exist on a
reimplementation: importing it raises the same error.
"""
from __future__ import annotations

from typing import NoReturn

from ipuxl.device.device_info import DeviceInfo, DeviceManager, DeviceSelectionCriterion, DeviceType
from ipuxl import log
from ipuxl.errors import CompatImportError
from ipuxl.errors import ApplicationRuntimeError as poplar_application_runtime_error  # noqa: N813 - PopART's names
from ipuxl.errors import DeviceError as poplar_runtime_error  # noqa: N813
from ipuxl.errors import PopartException as popart_exception  # noqa: N813
from ipuxl.ir.context import user_source_line
from ipuxl.ir.popart_options import SessionOptions
from ipuxl.popart_compat.enums import (
    AccumulateOuterFragmentSchedule, BatchSerializationBatchSchedule, BatchSerializationMethod,
    BatchSerializationTransformContext, DataType, DeviceConnectionType, ExecutionPhaseIOSchedule, ExecutionPhaseSchedule,
    GradientTensorTrackingMethod, Instrumentation, IrSerializationFormat, MeanReductionStrategy, MergeVarUpdateType,
    RecomputationType, ReductionType, ReplicatedTensorSharding, SubgraphCopyingStrategy, SyncPattern,
    SyntheticDataMode, TensorStorage, TileSet, VirtualGraphMode,
)

__all__ = [
    "versionString", "versionNumber", "SessionOptions", "__version__", "popart_exception", "poplar_runtime_error",
    "poplar_application_runtime_error",
    "AccumulateOuterFragmentSchedule", "BatchSerializationBatchSchedule", "BatchSerializationMethod",
    "BatchSerializationTransformContext", "DeviceConnectionType", "ExecutionPhaseIOSchedule", "ExecutionPhaseSchedule",
    "GradientTensorTrackingMethod", "Instrumentation", "IrSerializationFormat", "MeanReductionStrategy",
    "MergeVarUpdateType", "RecomputationType", "ReductionType", "ReplicatedTensorSharding", "SubgraphCopyingStrategy",
    "SyncPattern", "SyntheticDataMode", "TensorStorage", "TileSet", "VirtualGraphMode",
    "DeviceManager", "DeviceInfo", "DeviceType", "DeviceSelectionCriterion", "Logger", "getLogger", "DataType",
]

#: The PopART release whose PopXL API ipuxl reproduces (Poplar SDK 3.3).
__version__ = "3.3.0"


def versionString() -> str:  # noqa: N802 - PopART's name
    """PopART's version string, ``"<major>.<minor>.<patch> (ipuxl)"``."""
    return f"{__version__} (ipuxl)"


def versionNumber() -> tuple[int, int, int]:  # noqa: N802
    """PopART's version as ``(major, minor, patch)``."""
    major, minor, patch = (int(part) for part in __version__.split("."))
    return major, minor, patch


class Logger:
    """PopART's logger (``popart.getLogger()``): its level is ipuxl's (``ipuxl.log``), and its
    messages go to ipuxl's logger, where PopART's would go to its own stderr sink."""

    def __init__(self, name: str = "all"):
        self.name = name
        self._logger = log.logger if name == "all" else log.logger.getChild(name)

    def setLevel(self, level: str) -> None:  # noqa: N802 - PopART's names
        """PopART's level names: ``TRACE``, ``DEBUG``, ``INFO``, ``WARN``, ``ERR``, ``CRITICAL``, ``OFF``."""
        log.set_log_level(level)

    def trace(self, msg: str) -> None:
        self._logger.debug(msg)

    def debug(self, msg: str) -> None:
        self._logger.debug(msg)

    def info(self, msg: str) -> None:
        self._logger.info(msg)

    def warn(self, msg: str) -> None:
        self._logger.warning(msg)

    def error(self, msg: str) -> None:
        self._logger.error(msg)

    def critical(self, msg: str) -> None:
        self._logger.critical(msg)


def getLogger(name: str = "all") -> Logger:  # noqa: N802 - PopART's name
    """PopART's logger of module ``name`` (``"all"``: every module's)."""
    return Logger(name)


def __getattr__(name: str) -> NoReturn:
    """Any other public PopART name: ``CompatImportError`` naming it (private and dunder
    names raise ``AttributeError``, as for any module, so introspection keeps working)."""
    if name.startswith("_"):
        raise AttributeError(f"module 'popart' has no attribute '{name}'")
    error = CompatImportError(f"'popart.{name}' is part of PopART but ipuxl does not provide it: ipuxl's popart "
                              "holds only the enums and SessionOptions that PopXL and PopTorch programs pass",
                              where=user_source_line(),
                              fix="build graphs with PopXL (import popxl) or PopTorch, or remove the use of "
                                  f"popart.{name}")
    error.name = f"popart.{name}"
    raise error
