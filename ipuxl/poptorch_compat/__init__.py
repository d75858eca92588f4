"""PopTorch's programming model on ipuxl, and PopTorch's public namespace.

``ipuxl.compat`` maps ``import poptorch`` to this package, so every name PopTorch
exports at its top level (``poptorch.trainingModel``, ``poptorch.Options``,
``poptorch.enums``, ``poptorch.for_loop`` ...) is an attribute here, loaded on
first use from the module that defines it (``_LAZY``). The package is shaped like
its pipeline: what the user writes, the compiler, the runtime.

PopTorch's namespace (the modules ``poptorch.X`` maps to, and the user's API):

* ``options`` (``recorded_options``, ``option_groups``), ``enums``: ``Options`` and the enums;
* ``ops`` (a package): ``for_loop``, ``cond``, ``ipu_print_tensor``, ``CPU``...;
* ``optim`` (``optim_base``): PopTorch's optimisers;
* ``dataloader``, ``accessor``, ``custom_args``: ``DataLoader``, ``AsynchronousDataAccessor``,
  ``ICustomArgParser``;
* ``blocks``: ``Block``, ``BeginBlock``, ``Stage`` and the execution strategies;
* ``poptorch_logging`` (``poptorch.logging``), ``hardware``, ``poptorch_core`` (the
  Python-visible names of upstream's C++ extension), ``session_options`` (the backend's
  check and log of an options dict).

``compile/``: a wrapped model to a device program (``compile_model``: capture -> IR ->
autodiff -> step program -> outline), with the program's stream layout (``batching``),
anchors, optimiser plans (``translate``), block placement and pipelining.

``runtime/``: the program run on a device ``Session``: ``executor`` (``trainingModel``,
``inferenceModel``, ``PoplarExecutor``), ``compiled_model``, where the weights live and
when they move (``weights``, ``weight_sync``), executable files, perf counters.

Imports point one way: the namespace modules import neither ``compile`` nor ``runtime``,
and ``compile`` never imports ``runtime`` (``tests/test_layering.py``). The wrappers are
built from the same pieces as the PopXL front end: torch.fx capture into the IR
(``ipuxl.capture``), ``transforms.autodiff``, the ``ipuxl.optim`` update rules and the
device ``Session``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ipuxl.lazy import lazy_names

if TYPE_CHECKING:
    from ipuxl.capture.dropout import DropoutReplay
    from ipuxl.capture.mode import identity_loss
    from ipuxl.poptorch_compat.dataloader import DataLoader, DataLoaderMode
    from ipuxl.poptorch_compat.accessor import AsynchronousDataAccessor
    from ipuxl.poptorch_compat.custom_args import ICustomArgParser, registerCustomArgParser
    from ipuxl.poptorch_compat.runtime.executor import PoplarExecutor, inferenceModel, trainingModel
    from ipuxl.poptorch_compat.runtime.executor import load
    from ipuxl.poptorch_compat.compile.hooks import registerPostCompileHook, registerPreCompileHook
    from ipuxl.poptorch_compat.options import AnchorMode, Options, OutputMode
    from ipuxl.errors import ConfigFileError, RecoverableError, UnrecoverableError
    from ipuxl.errors import PoptorchError as Error
    from ipuxl.poptorch_compat import enums, options
    from ipuxl.poptorch_compat import poptorch_logging as logging
    from ipuxl.poptorch_compat import poptorch_core
    from ipuxl.poptorch_compat.enums import (
        AutoStage, CommGroupType, ConnectionType, HalfFloatCastingBehavior, Liveness, MatMulSerializationMode,
        MeanReductionStrategy, MultiConvPlanType, OverlapMode, ReductionType, SharingStrategy, SyncPattern,
        VariableRetrievalMode,
    )
    from ipuxl.poptorch_compat.hardware import ipuHardwareIsAvailable, ipuHardwareVersion, isRunningOnIpu
    from ipuxl.poptorch_compat.option_groups import TensorLocationSettings
    from ipuxl.poptorch_compat.blocks import (
        BeginBlock, Block, BlockFunction, ParallelPhasedExecution, Phase, PipelinedExecution, SerialPhasedExecution,
        ShardedExecution, Stage, removeBlocks,
    )
    from ipuxl.poptorch_compat.poptorch_logging import logger, setLogLevel
    from ipuxl.poptorch_compat.ops import (
        CPU, Attribute, MultiConv, NameScope, cond, ctc_beam_search_decoder, custom_op, dynamic_slice, dynamic_update,
        for_loop, fps, ipu_print_tensor, nearest, nop, recomputationCheckpoint, serializedMatMul, set_available_memory,
        set_overlap_for_input, set_overlap_for_output,
    )

#: PopTorch's top-level name -> (module, attribute in it; None for the module itself), loaded on first use
_LAZY: dict[str, tuple[str, str | None]] = {
    "DropoutReplay": ("ipuxl.capture.dropout", "DropoutReplay"),
    "identity_loss": ("ipuxl.capture.mode", "identity_loss"),
    "PoplarExecutor": ("ipuxl.poptorch_compat.runtime.executor", "PoplarExecutor"),
    "trainingModel": ("ipuxl.poptorch_compat.runtime.executor", "trainingModel"),
    "inferenceModel": ("ipuxl.poptorch_compat.runtime.executor", "inferenceModel"),
    "load": ("ipuxl.poptorch_compat.runtime.executor", "load"),
    "__version__": ("ipuxl.poptorch_compat.runtime.executor", "POPTORCH_VERSION"),
    "registerPreCompileHook": ("ipuxl.poptorch_compat.compile.hooks", "registerPreCompileHook"),
    "registerPostCompileHook": ("ipuxl.poptorch_compat.compile.hooks", "registerPostCompileHook"),
    "Options": ("ipuxl.poptorch_compat.options", "Options"),
    "AnchorMode": ("ipuxl.poptorch_compat.options", "AnchorMode"),
    "OutputMode": ("ipuxl.poptorch_compat.options", "OutputMode"),
    "DataLoader": ("ipuxl.poptorch_compat.dataloader", "DataLoader"),
    "DataLoaderMode": ("ipuxl.poptorch_compat.dataloader", "DataLoaderMode"),
    "AsynchronousDataAccessor": ("ipuxl.poptorch_compat.accessor", "AsynchronousDataAccessor"),
    "ICustomArgParser": ("ipuxl.poptorch_compat.custom_args", "ICustomArgParser"),
    "registerCustomArgParser": ("ipuxl.poptorch_compat.custom_args", "registerCustomArgParser"),
    "optim": ("ipuxl.poptorch_compat.optim", None),
    "for_loop": ("ipuxl.poptorch_compat.ops", "for_loop"),
    "cond": ("ipuxl.poptorch_compat.ops", "cond"),
    "dynamic_slice": ("ipuxl.poptorch_compat.ops", "dynamic_slice"),
    "dynamic_update": ("ipuxl.poptorch_compat.ops", "dynamic_update"),
    "ipu_print_tensor": ("ipuxl.poptorch_compat.ops", "ipu_print_tensor"),
    "nop": ("ipuxl.poptorch_compat.ops", "nop"),
    "recomputationCheckpoint": ("ipuxl.poptorch_compat.ops", "recomputationCheckpoint"),
    "serializedMatMul": ("ipuxl.poptorch_compat.ops", "serializedMatMul"),
    "set_available_memory": ("ipuxl.poptorch_compat.ops", "set_available_memory"),
    "set_overlap_for_input": ("ipuxl.poptorch_compat.ops", "set_overlap_for_input"),
    "set_overlap_for_output": ("ipuxl.poptorch_compat.ops", "set_overlap_for_output"),
    "MultiConv": ("ipuxl.poptorch_compat.ops", "MultiConv"),
    "NameScope": ("ipuxl.poptorch_compat.ops", "NameScope"),
    "Attribute": ("ipuxl.poptorch_compat.ops", "Attribute"),
    "hasMlirSupportOnPlatform": ("ipuxl.poptorch_compat.hardware", "hasMlirSupportOnPlatform"),
    "createPoptorchError": ("ipuxl.poptorch_compat.poptorch_core", "createPoptorchError"),
    "CPU": ("ipuxl.poptorch_compat.ops", "CPU"),
    "Attribute": ("ipuxl.poptorch_compat.ops", "Attribute"),
    "custom_op": ("ipuxl.poptorch_compat.ops", "custom_op"),
    "ctc_beam_search_decoder": ("ipuxl.poptorch_compat.ops", "ctc_beam_search_decoder"),
    "fps": ("ipuxl.poptorch_compat.ops", "fps"),
    "nearest": ("ipuxl.poptorch_compat.ops", "nearest"),
    "AutoStage": ("ipuxl.poptorch_compat.enums", "AutoStage"),
    "CommGroupType": ("ipuxl.poptorch_compat.enums", "CommGroupType"),
    "ConnectionType": ("ipuxl.poptorch_compat.enums", "ConnectionType"),
    "HalfFloatCastingBehavior": ("ipuxl.poptorch_compat.enums", "HalfFloatCastingBehavior"),
    "Liveness": ("ipuxl.poptorch_compat.enums", "Liveness"),
    "MatMulSerializationMode": ("ipuxl.poptorch_compat.enums", "MatMulSerializationMode"),
    "MeanReductionStrategy": ("ipuxl.poptorch_compat.enums", "MeanReductionStrategy"),
    "MultiConvPlanType": ("ipuxl.poptorch_compat.enums", "MultiConvPlanType"),
    "OverlapMode": ("ipuxl.poptorch_compat.enums", "OverlapMode"),
    "ReductionType": ("ipuxl.poptorch_compat.enums", "ReductionType"),
    "SharingStrategy": ("ipuxl.poptorch_compat.enums", "SharingStrategy"),
    "SyncPattern": ("ipuxl.poptorch_compat.enums", "SyncPattern"),
    "VariableRetrievalMode": ("ipuxl.poptorch_compat.enums", "VariableRetrievalMode"),
    "enums": ("ipuxl.poptorch_compat.enums", None),
    "options": ("ipuxl.poptorch_compat.options", None),
    "logging": ("ipuxl.poptorch_compat.poptorch_logging", None),
    "_logging": ("ipuxl.poptorch_compat.poptorch_logging", None),
    "poptorch_core": ("ipuxl.poptorch_compat.poptorch_core", None),
    "logger": ("ipuxl.poptorch_compat.poptorch_logging", "logger"),
    "setLogLevel": ("ipuxl.poptorch_compat.poptorch_logging", "setLogLevel"),
    "ipuHardwareIsAvailable": ("ipuxl.poptorch_compat.hardware", "ipuHardwareIsAvailable"),
    "ipuHardwareVersion": ("ipuxl.poptorch_compat.hardware", "ipuHardwareVersion"),
    "isRunningOnIpu": ("ipuxl.poptorch_compat.hardware", "isRunningOnIpu"),
    "TensorLocationSettings": ("ipuxl.poptorch_compat.option_groups", "TensorLocationSettings"),
    "Block": ("ipuxl.poptorch_compat.blocks", "Block"),
    "BeginBlock": ("ipuxl.poptorch_compat.blocks", "BeginBlock"),
    "BlockFunction": ("ipuxl.poptorch_compat.blocks", "BlockFunction"),
    "removeBlocks": ("ipuxl.poptorch_compat.blocks", "removeBlocks"),
    "Stage": ("ipuxl.poptorch_compat.blocks", "Stage"),
    "Phase": ("ipuxl.poptorch_compat.blocks", "Phase"),
    "PipelinedExecution": ("ipuxl.poptorch_compat.blocks", "PipelinedExecution"),
    "ShardedExecution": ("ipuxl.poptorch_compat.blocks", "ShardedExecution"),
    "SerialPhasedExecution": ("ipuxl.poptorch_compat.blocks", "SerialPhasedExecution"),
    "ParallelPhasedExecution": ("ipuxl.poptorch_compat.blocks", "ParallelPhasedExecution"),
    "ConfigFileError": ("ipuxl.errors", "ConfigFileError"),
    "Error": ("ipuxl.errors", "PoptorchError"),
    "RecoverableError": ("ipuxl.errors", "RecoverableError"),
    "UnrecoverableError": ("ipuxl.errors", "UnrecoverableError"),
}


__getattr__, __dir__ = lazy_names("ipuxl.poptorch_compat", globals(), _LAZY, "PopTorch")


__all__ = sorted(n for n in _LAZY if not n.startswith("_") and n != "poptorch_core")
