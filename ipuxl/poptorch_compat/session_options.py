"""How PopTorch's backend reads an ``Options.toDict()``: each value is checked and
logged, as upstream's ``SessionOptions`` parser does.

Upstream passes ``Options.toDict()`` (and its execution strategy's backend options)
to its C++ backend, which sets each key on PopTorch's or PopART's session options and
logs it at debug level on the ``poptorch:cpp`` logger; a key neither knows is an
error, and so is a value of a type the parser cannot take. ipuxl does the same walk
when a model is compiled (``log_session_options``) and for
``poptorch.poptorch_core._validateOptions``:

* a bool, int or float: ``poptorch.Options set <key> to value <value>`` (bools as
  ``true``/``false``);
* a string: ``poptorch.Options set <key> to value <value>``;
* a list, tuple or set: ``poptorch.Options added <item> to <key>`` for each item;
* a dict: ``poptorch.Options set <key>[<name>] to <value>`` for each item.

The keys known are PopTorch's own (the keys ``Options.toDict()`` writes, ipuxl's
additions included) and PopART's session options by name (``POPART_OPTIONS``:
PopART 3.3's, as PopTorch 3.3 accepts them through ``Options._Popart.set``). ipuxl
has no PopART: a PopART option is checked and logged, and has no effect unless the
setter that wrote it says so (``docs/poptorch.md``).
"""
from __future__ import annotations

import enum
import logging
from typing import Any, Iterator

from ipuxl.errors import PoptorchError
from ipuxl.poptorch_compat.poptorch_logging import cpp_logger

__all__ = ["POPART_OPTIONS", "session_options", "parse_session_options", "log_session_options"]

#: PopART session options by name (dotted for the fields of a settings struct)
POPART_OPTIONS: frozenset[str] = frozenset({
    # enums
    "batchSerializationSettings.transformContext", "batchSerializationSettings.method",
    "batchSerializationSettings.batchSchedule", "autoRecomputation", "mergeVarUpdate", "virtualGraphMode",
    "syntheticDataMode", "subgraphCopyingStrategy", "accumulationAndReplicationReductionType",
    "meanAccumulationAndReplicationReductionStrategy", "accumulateOuterFragmentSettings.schedule",
    "automaticLossScalingSettings.gradientTensorTrackingMethod", "executionPhaseSettings.weightIOSchedule",
    "executionPhaseSettings.activationIOSchedule", "executionPhaseSettings.optimizerStateIOSchedule",
    "executionPhaseSettings.accumulatorIOSchedule", "executionPhaseSettings.schedule",
    # strings
    "logDir", "cachePath", "partialsTypeMatMuls", "customCodeletCompileFlags", "serializedPoprithmsShiftGraphsDir",
    "kahnTieBreaker", "saveInitializersToFile",
    # integers
    "executionPhaseSettings.phases", "executionPhaseSettings.stages", "batchSerializationSettings.factor",
    "firstDotOp", "finalDotOp", "numIOTiles", "mergeVarUpdateMemThreshold", "looseThresholdAtPeak",
    "accumulationFactor", "swapLimitScheduler", "globalReplicationFactor", "globalReplicaOffset",
    "defaultPrefetchBufferingDepth", "replicatedGraphCount", "compileEngine", "transitiveClosureOptimizationThreshold",
    "automaticLossScalingSettings.updatePeriod",
    # booleans
    "batchSerializationSettings.concatOnVirtualGraphChange", "batchSerializationSettings.concatOnExecutionPhaseChange",
    "batchSerializationSettings.concatOnPipelineStageChange", "strictOpVersions", "opxAliasChecking",
    "opxModifyChecking", "dotOpNames", "exportPoplarComputationGraph", "exportPoplarVertexGraph",
    "separateCallOpPdfs", "enableOutlining", "enableOutliningCopyCostPruning", "rearrangeAnchorsOnHost",
    "rearrangeStreamsOnHost", "enablePrefetchDatastreams", "enableNonStableSoftmax", "enableReplicatedGraphs",
    "enableGradientAccumulation", "instrumentWithHardwareCycleCounter", "enablePipelining",
    "disableGradAccumulationTensorStreams", "constantWeights", "enableEngineCaching", "enableFloatingPointChecks",
    "enableStochasticRounding", "explicitRecomputation", "aliasZeroCopy", "delayVarUpdates",
    "enableFullyConnectedPass", "enableGroupedMatmuls", "enableSerializedMatmuls", "enableStableNorm",
    "hostAllReduce", "hostWeightUpdate", "hostAllReduceRemoteBuffer", "decomposeGradSum",
    "enableDistributedReplicatedGraphs", "groupHostSync", "automaticLossScalingSettings.enabled",
    "enableSupportedDataTypeCasting", "groupNormStridedChannelGrouping", "enableExplicitIR",
    "enableExplicitMainLoops", "useHostCopyOps", "enableInplaceAmbiguityChecking", "enableLoadAndOffloadRNGState",
    "scheduleNonWeightUpdateGradientConsumersEarly", "ensureFp32LossScaleTensor", "enableMergeExchange",
    "createImplicitPipeliningFwdOnlyProgram", "throwIfLog2ScaleTensorNotInRange", "enableConstantFoldingOfMultipleConsumers",
    "useLoopCandidateCreator", "stashAllTensorsInferencePipeline", "enableRngStateManagement",
    # floating point
    "outlineSequenceBreakCost", "outlineThreshold", "timeLimitScheduler",
    "automaticLossScalingSettings.binEdgeLocation", "automaticLossScalingSettings.thresholdUpperCountProportion",
    # containers
    "dotChecks", "hardwareInstrumentations", "customCodelets", "engineOptions", "reportOptions",
    "convolutionOptions", "matmulOptions", "lstmOptions", "gclOptions", "tensorLocationSettingsOverride",
    "accumulateOuterFragmentSettings.excludedVirtualGraphs", "automaticLossScalingSettings.toTrackTensors",
    "automaticLossScalingSettings.toTrackTensorsAndOps",
})

# PopTorch's own keys that its backend reads apart from the generic walk: the anchors
# are compiled into the program, the memory proportions have their own setter upstream,
# and ``patterns`` goes with its level; a tensor location logs each of its settings.
_SPECIAL = frozenset({"anchored_tensors", "available_memory_proportion", "patterns", "patterns_level"})
_LOCATIONS = ("location_activation", "location_weight", "location_optimizer", "location_accumulator")
_KIND = {bool: "bool", int: "uint64", float: "floating point", str: "string", list: "set / vector",
         tuple: "set / vector", set: "set / vector", frozenset: "set / vector", dict: "map"}


def session_options(options: Any) -> dict[str, Any]:
    """What upstream's backend receives for ``options``: ``toDict()`` and the execution
    strategy's backend options (``execution_mode``...; PopTorch's default strategy,
    ``PipelinedExecution``, when none was set)."""
    values = dict(options.toDict())
    strategy = getattr(options, "execution_strategy", None)
    values.update(strategy.backendOptions() if strategy is not None else {"execution_mode": 0})
    return values


def _kind(value: Any) -> str | None:
    for python_type, kind in _KIND.items():
        if isinstance(value, python_type):
            return kind
    return None


#: PopTorch's keys that ``toDict()`` writes only once their setter was called
_SET_ONLY = ("random_seed", "ipu_version", "ipu_id", "model_name", "serial_phases_execution",
             "separate_backward_phase", "tensors_liveness", *_LOCATIONS)


def _known_keys() -> Iterator[str]:
    from ipuxl.poptorch_compat.options_env import pristine_options  # (imports this module's importers' module)

    yield from session_options(pristine_options())  # upstream's keys, whatever POPTORCH_DEFAULT_OPTIONS sets
    yield from _SET_ONLY


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def parse_session_options(values: dict[str, Any], *, strict: bool = True) -> list[str]:
    """Check every key and value of an ``Options.toDict()`` as upstream's backend does,
    and return the lines it logs for them (see the module docstring).

    With ``strict=False`` (what a compile uses), an option nobody knows is skipped with a
    warning instead of refused: ``POPART_OPTIONS`` lists PopART's options as PopTorch 3.3
    sets them, and a PopART option missing from it should not stop a model that
    upstream compiles.

    Raises:
        PoptorchError: a key that neither PopTorch nor PopART has ("Unknown <kind>
            option <key>"), or a value of a type the parser cannot take ("Unknown
            value type <type> for option <key>").
    """
    known = set(_known_keys()) | POPART_OPTIONS
    lines: list[str] = []
    for key, value in values.items():
        if key in _SPECIAL or value is None:
            continue
        kind = _kind(value)
        if kind is None:
            raise PoptorchError(f"Unknown value type {type(value)} for option {key}",
                                fix="PopTorch's options take a bool, int, float, string, list, set or dict")
        if key not in known and not strict:
            cpp_logger.warning("Ignoring unknown %s option %s: neither PopTorch nor PopART (as ipuxl knows "
                               "it) has it", kind, key)
            continue
        if key not in known:
            raise PoptorchError(f"Unknown {kind} option {key}",
                                fix="check the option's name (PopTorch's Options setters, or PopART's "
                                    "SessionOptions field for Options._Popart.set)")
        if key in _LOCATIONS:
            lines += [f"Setting {name} to {_text(item)} for location {key}" for name, item in value.items()]
        elif isinstance(value, dict):
            lines += [f"poptorch.Options set {key}[{name}] to {_text(item)}" for name, item in value.items()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            lines += [f"poptorch.Options added {_text(item)} to {key}" for item in value]
        else:
            lines.append(f"poptorch.Options set {key} to value {_text(value)}")
    return lines


def log_session_options(values: dict[str, Any]) -> None:
    """Parse ``values`` (``parse_session_options``) and log each line at debug level on
    the ``poptorch:cpp`` logger, as upstream's backend does when it compiles."""
    lines = parse_session_options(values, strict=False)
    if cpp_logger.isEnabledFor(logging.DEBUG):
        for line in lines:
            cpp_logger.debug(line)
