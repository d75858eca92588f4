"""PopTorch's ``Options``: how a model is compiled, batched, replicated and returns outputs.

This follows PopTorch 3.x's ``poptorch.Options`` (``python/options.py``, the freezing
rules of ``OptionsDict`` in ``python/_options_impl.py``): every setter and sub-object
upstream has, with upstream's argument checks and defaults.

* Setters are camelCase and chainable (each returns the object it was called on):
  ``Options().deviceIterations(4).replicationFactor(2)``; the sub-objects are
  ``opts.Training``, ``opts.Precision``, ``opts.Distributed``, ``opts.Jit``,
  ``opts.TensorLocations`` and ``opts._Popart`` (``ipuxl.poptorch_compat.option_groups``).
* ``toDict()`` gives every value under upstream's keys (one flat dict); ``clone()`` and
  ``copy.deepcopy`` give an unfrozen deep copy; ``exists(key)``, read access by key
  (``opts.log_dir``) and assignment (``opts.replication_factor = 4``: the setter runs)
  work as upstream; ``loadFromFile(path)`` runs one setter call per line; a new
  ``Options()`` applies ``POPTORCH_DEFAULT_OPTIONS`` (``options_env``).
* Options freeze when a model is wrapped or compiled with them or an ``ipuxl.DataLoader``
  is built from them (upstream's ``_freeze()``); changing them then raises
  :class:`~ipuxl.errors.FrozenOptionsError` (an AttributeError, as upstream).
  ``model_options`` prepares a model's own copy, as upstream's ``PoplarExecutor``.
* Bad arguments raise :class:`~ipuxl.errors.OptionsError`, both a ValueError and an
  AssertionError (upstream raises one or the other, setter by setter).

Honoured by the simulation: ``deviceIterations``, ``replicationFactor``,
``Training.gradientAccumulation``, ``outputMode`` (``OutputMode.Default`` is ``Final``
for training and ``All`` for inference), ``randomSeed`` (also seeds torch's host RNG, as
upstream), ``Distributed`` (process id and count: each process runs
``replicationFactor`` replicas, as upstream),
``useIpuModel`` (the ``"ipu_model"`` device with its memory model). Recorded for the
compile path (read them from the properties below): ``Training``'s reduction type and
mean strategy, ``Precision``'s casting, running-statistics and partials settings,
``inputReplicaGrouping``, ``anchorTensor``, ``connectionType``,
``showCompilationProgressBar``, ``setExecutionStrategy`` (stages and IPUs of the blocks:
``poptorch_compat.blocks``). No effect on a simulated device (recorded and shown by
``toDict()`` only): the setters inherited from ``recorded_options.RecordedOptions``
(``syncPattern``, ``useIpuId``, ``enableExecutableCaching``, ``enableProfiling``,
``logDir``, ``setAvailableMemoryProportion``...), ``useOfflineIpuTarget``'s version,
``Jit.traceModel``, ``TensorLocations``, ``_Popart``. ``docs/poptorch.md`` gives the
reason for each.

ipuxl additions: ``staticShapes()``, ``autoOutline()``, ``anchorMode`` (upstream's
pre-3.0 spelling of ``outputMode``), read-only snake_case properties for the compiler,
``device_type``, ``resolved_output_mode``, ``combined_batch_factor`` and ``to_dict()``
(the values the compiled program depends on).
"""
from __future__ import annotations

import copy
import enum
import os
import warnings
from typing import Any, Literal

import torch

from ipuxl.errors import ConfigFileError, InferenceOptionsError, InvalidArgumentError, OptionsError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.blocks import PipelinedExecution, ShardedExecution
from ipuxl.poptorch_compat.enums import CommGroupType, ConnectionType, SyncPattern
from ipuxl.poptorch_compat.option_groups import (
    DistributedOptions, JitOptions, PopartOptions, PrecisionOptions, TensorLocationOptions, TensorLocationSettings,
    TrainingOptions, check_enum, check_flag, check_int, check_positive_int, check_str, type_name,
)
from ipuxl.poptorch_compat.options_env import apply_env_defaults, pristine_options
from ipuxl.poptorch_compat.recorded_options import RecordedOptions

__all__ = ["AnchorMode", "ConfigFileError", "Options", "OutputMode", "TensorLocationSettings"]

# upstream's names of the sub-objects' classes (``poptorch.options._TrainingOptions``...)
_TrainingOptions = TrainingOptions
_DistributedOptions = DistributedOptions
_PrecisionOptions = PrecisionOptions
_JitOptions = JitOptions
_TensorLocationOptions = TensorLocationOptions
_PopartOptions = PopartOptions


class OutputMode(enum.IntEnum):
    """Which results a model returns to the host after running ``deviceIterations`` x
    ``gradientAccumulation`` x ``replicationFactor`` micro-batches (PopTorch's values).

    - ``Final``: only the result of the last batch.
    - ``EveryN``: the result of every N-th batch (N is ``output_return_period``).
    - ``All``: the result of every batch.
    - ``Sum``: the sum of the results of all the batches.
    - ``Default``: ``Final`` for training, ``All`` for inference.
    """

    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


#: Upstream's older name for :class:`OutputMode` (``poptorch.AnchorMode``, used with
#: ``Options.anchorMode``): the same enum, so ``AnchorMode.All is OutputMode.All``.
AnchorMode = OutputMode

_MAX_SEED = 2**64  # the IPU's seed is an unsigned 64-bit integer

# Attribute name -> the setter to use instead (for the "read-only" error message).
_SETTERS = {
    "device_iterations": "opts.deviceIterations(n)",
    "replication_factor": "opts.replicationFactor(n)",
    "gradient_accumulation": "opts.Training.gradientAccumulation(n)",
    "output_mode": "opts.outputMode(mode, output_return_period=None)",
    "output_return_period": "opts.outputMode(OutputMode.EveryN, n)",
    "anchor_mode": "opts.anchorMode(mode, anchor_return_period=None)",
    "anchor_return_period": "opts.anchorMode(AnchorMode.EveryN, n)",
    "random_seed": "opts.randomSeed(seed)",
    "use_ipu_model": "opts.useIpuModel(True)",
    "static_shapes": "opts.staticShapes(True)",
}

#: the values ``__repr__`` always shows (the rest only when changed), in this order
_CORE = ("device_iterations", "replication_factor", "gradient_accumulation", "output_mode", "output_return_period",
         "random_seed", "use_ipu_model", "static_shapes")


class Options(RecordedOptions):
    """Everything that controls how a model is compiled and run (PopTorch's ``Options``).

    >>> opts = Options().deviceIterations(4).replicationFactor(2)
    >>> opts.Training.gradientAccumulation(8)  # doctest: +ELLIPSIS
    _TrainingOptions(gradient_accumulation=8)
    >>> opts.combined_batch_factor(training=True)
    64

    Setters validate their argument and return ``self`` so that calls chain. The
    compiler reads the snake_case properties and calls ``freeze()``; after that any
    setter raises :class:`~ipuxl.errors.FrozenOptionsError` (use :meth:`clone`).
    """

    _path = "Options"
    _upstream_name = "Options"
    _ASSIGNED_BY = {
        "device_iterations": "deviceIterations", "replication_factor": "replicationFactor",
        "output_mode": "outputMode", "random_seed": "randomSeed", "use_model": "useIpuModel",
        "static_shapes": "staticShapes", "auto_outline": "autoOutline", "connection_type": "connectionType",
        "sync_pattern": "syncPattern", "log_dir": "logDir", "auto_round_num_ipus": "autoRoundNumIPUs",
        "broadcast_buffers": "broadcastBuffers", "show_compilation_progress_bar": "showCompilationProgressBar",
        "relax_optimizer_attributes_checks": "relaxOptimizerAttributesChecks"}

    def __init__(self) -> None:
        super().__init__(None, replication_factor=1, input_group_size=1, input_cgt=CommGroupType.Consecutive,
                         broadcast_buffers=True, device_iterations=1, log_dir=".", auto_round_num_ipus=False,
                         anchored_tensors={}, output_mode=OutputMode.Default, output_return_period=1,
                         connection_type=ConnectionType.Always, sync_pattern=SyncPattern.Full,
                         available_memory_proportion={}, use_model=False, updatable_named_buffers=[],
                         show_compilation_progress_bar=True, relax_optimizer_attributes_checks=False,
                         module_namescope_enabled=True, source_location_excludes=[], static_shapes=False,
                         auto_outline=True)
        self._frozen = False
        self._execution_strategy: object = PipelinedExecution()  # upstream's default strategy
        self._popart = PopartOptions(self)
        self._training = TrainingOptions(self, self._popart)
        self._distributed = DistributedOptions(self)
        self._precision = PrecisionOptions(self, self._popart)
        self._jit = JitOptions(self)
        self._tensor_locations = TensorLocationOptions(self)
        cache = os.environ.get("POPTORCH_CACHE_DIR", "")
        if cache:
            self.enableExecutableCaching(cache)
        apply_env_defaults(self)  # ``POPTORCH_DEFAULT_OPTIONS`` (``options_env``)

    def _setter_hint(self, name: str) -> str:
        setter = _SETTERS.get(name)
        return f"call {setter}" if setter else super()._setter_hint(name)

    # -- freezing -----------------------------------------------------------------
    def _is_frozen_now(self) -> bool:
        return self._frozen

    def freeze(self) -> None:
        """Forbid further changes (called when a model is compiled with these options, or a
        ``DataLoader`` built)."""
        self._frozen = True

    _freeze = freeze  # upstream's (private) spelling, which code written for PopTorch calls

    def unfreeze(self) -> None:
        """Allow changes again (upstream's private ``_unfreeze``)."""
        self._frozen = False

    _unfreeze = unfreeze

    @property
    def frozen(self) -> bool:
        """True once a model was compiled with these options (or a DataLoader built)."""
        return self._frozen

    def clone(self) -> Options:
        """An unfrozen deep copy of these options (the sub-objects included)."""
        return copy.deepcopy(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> Options:
        # as upstream's ``OptionsDict.__deepcopy__``: a copy of frozen options is not frozen
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            object.__setattr__(copied, key, False if key == "_frozen" else copy.deepcopy(value, memo))
        return copied

    # -- sub-objects --------------------------------------------------------------
    @property
    def Training(self) -> TrainingOptions:  # noqa: N802 - PopTorch's public name
        """Options specific to training (``opts.Training.gradientAccumulation(n)``)."""
        return self._training

    @property
    def Distributed(self) -> DistributedOptions:  # noqa: N802 - PopTorch's public name
        """Options of a run over several host processes
        (``opts.Distributed.configureProcessId(process_id, num_processes)``)."""
        return self._distributed

    @property
    def Precision(self) -> PrecisionOptions:  # noqa: N802 - PopTorch's public name
        """float16 handling (``opts.Precision.setPartialsType(torch.half)``)."""
        return self._precision

    @property
    def Jit(self) -> JitOptions:  # noqa: N802 - PopTorch's public name
        """Upstream's tracing choice (no effect: ipuxl captures through the dispatcher)."""
        return self._jit

    @property
    def TensorLocations(self) -> TensorLocationOptions:  # noqa: N802 - PopTorch's public name
        """Where tensors are stored (recorded; no effect on a simulated device)."""
        return self._tensor_locations

    @property
    def _Popart(self) -> PopartOptions:  # noqa: N802 - PopTorch's public name
        """PopART session options by name (recorded; no effect on a simulated device)."""
        return self._popart

    # -- batching, replication, outputs (honoured) ----------------------------------
    def deviceIterations(self, device_iterations: int) -> Options:  # noqa: N802
        """Number of iterations the device runs over new batches before returning to
        the host (default: 1)."""
        self._check_not_frozen("deviceIterations")
        value = check_positive_int(device_iterations, method="Options.deviceIterations", arg="device_iterations",
                                   example="opts.deviceIterations(4)")
        self._set("deviceIterations", device_iterations=value)
        return self

    def replicationFactor(self, replication_factor: int) -> Options:  # noqa: N802
        """Number of replicas of the model, each fed its own micro-batches (default: 1).

        As upstream, this counts the replicas of this process: with ``num_processes``
        processes (torchrun, or ``opts.Distributed.configureProcessId``) each one runs
        and feeds ``replication_factor`` replicas, ``replication_factor x num_processes``
        in all (``total_replicas()``)."""
        self._check_not_frozen("replicationFactor")
        value = check_positive_int(replication_factor, method="Options.replicationFactor", arg="replication_factor",
                                   example="opts.replicationFactor(2)")
        self._set("replicationFactor", replication_factor=value)
        return self

    def inputReplicaGrouping(self, input_group_size: int, input_group_type: CommGroupType) -> Options:  # noqa: N802
        """Replicas in one group of ``input_group_size`` get the same input batch
        (``CommGroupType.Consecutive`` or ``Orthogonal`` groups; ``NoGrouping`` means each
        replica its own): the combined batch then holds ``replicationFactor / input_group_size``
        slices per step (``compile.batching.replica_groups``)."""
        self._check_not_frozen("inputReplicaGrouping")
        size = check_positive_int(input_group_size, method="Options.inputReplicaGrouping", arg="input_group_size",
                                  example="opts.inputReplicaGrouping(2, poptorch.CommGroupType.Consecutive)")
        kind = check_enum(input_group_type, CommGroupType, method="Options.inputReplicaGrouping",
                          arg="input_group_type",
                          allowed=(CommGroupType.Consecutive, CommGroupType.Orthogonal, CommGroupType.NoGrouping))
        self._set("inputReplicaGrouping", input_group_size=size, input_cgt=kind)
        return self

    def outputMode(self, output_mode: OutputMode, output_return_period: int | None = None) -> Options:  # noqa: N802
        """Which results to return to the host: see :class:`OutputMode`.

        ``OutputMode.EveryN`` needs ``output_return_period`` (a positive int). With any
        other mode a period is ignored, as upstream does; ipuxl warns about it.
        """
        return self._set_output_mode("outputMode", "output_mode", "output_return_period",
                                     output_mode, output_return_period)

    def anchorMode(self, anchor_mode: OutputMode, anchor_return_period: int | None = None) -> Options:  # noqa: N802
        """Upstream's pre-3.0 spelling of :meth:`outputMode` (takes :data:`AnchorMode`)."""
        return self._set_output_mode("anchorMode", "anchor_mode", "anchor_return_period",
                                     anchor_mode, anchor_return_period)

    def _set_output_mode(self, method: str, mode_arg: str, period_arg: str,
                         mode: object, period: object) -> Options:
        self._check_not_frozen(method)
        value = check_enum(mode, OutputMode, method=f"Options.{method}", arg=mode_arg)
        resolved_period = 1
        if value is OutputMode.EveryN:
            if period is None:
                raise OptionsError(
                    f"Options.{method}: OutputMode.EveryN needs {period_arg}, the number of batches "
                    "between two returned results",
                    where=user_source_line(), fix=f"call opts.{method}(OutputMode.EveryN, 10)")
            resolved_period = check_positive_int(period, method=f"Options.{method}", arg=period_arg,
                                                 example=f"opts.{method}(OutputMode.EveryN, 10)")
        elif period is not None:
            warnings.warn(
                f"Options.{method}: {period_arg}={period!r} is ignored with OutputMode.{value.name} "
                "(it only applies to OutputMode.EveryN)", UserWarning, stacklevel=3)
        self._set(method, output_mode=value, output_return_period=resolved_period)
        return self

    def defaultOutputMode(self) -> bool:  # noqa: N802
        """True while the output mode is still ``OutputMode.Default`` (as upstream)."""
        return self._values["output_mode"] is OutputMode.Default

    def anchorTensor(self, short_name: str, long_name: str, output_mode: OutputMode | None = None,  # noqa: N802
                     output_return_period: int | None = 1) -> Options:
        """Return the tensor PopART calls ``long_name`` as ``short_name`` after each run
        (``output_mode`` None: the model's output mode). Recorded in
        :attr:`anchored_tensors` for the executor."""
        self._check_not_frozen("anchorTensor")
        for arg, value in (("short_name", short_name), ("long_name", long_name)):
            check_str(value, method="Options.anchorTensor", arg=arg, example='"grad_w"')
        if output_mode is not None:
            check_enum(output_mode, OutputMode, method="Options.anchorTensor", arg="output_mode")
        period = 1
        if output_mode is OutputMode.EveryN:
            period = check_positive_int(output_return_period, method="Options.anchorTensor",
                                        arg="output_return_period", example="10")
        anchors = dict(self._values["anchored_tensors"])
        anchors[short_name] = [long_name, output_mode is None, output_mode, period]
        self._set("anchorTensor", anchored_tensors=anchors)
        return self

    def randomSeed(self, random_seed: int) -> Options:  # noqa: N802
        """Seed the device's random number generator; like upstream, also seeds torch's
        host RNG with ``torch.manual_seed(random_seed)``."""
        self._check_not_frozen("randomSeed")
        seed = check_int(random_seed, method="Options.randomSeed", arg="random_seed", example="opts.randomSeed(42)")
        if not 0 <= seed < _MAX_SEED:
            raise OptionsError(
                f"Options.randomSeed: random_seed must be in [0, 2**64), got {seed}",
                where=user_source_line(), fix="pass a non-negative seed below 2**64, for example 42")
        torch.manual_seed(seed)
        self._set("randomSeed", random_seed=seed)
        return self

    def useIpuModel(self, use_model: bool) -> Options:  # noqa: N802
        """Run on the IPU Model (a simulator) instead of IPU hardware (default: False).

        ipuxl always simulates; this picks the ``"ipu_model"`` device, which checks the
        program against one IPU's memory (see :attr:`device_type`)."""
        self._check_not_frozen("useIpuModel")
        self._set("useIpuModel", use_model=check_flag(use_model, method="Options.useIpuModel", arg="use_model"))
        return self

    def staticShapes(self, enabled: bool = True) -> Options:  # noqa: N802
        """ipuxl extension: when enabled, a compiled model raises an error instead of
        recompiling when the shapes of its inputs change (default: False)."""
        self._check_not_frozen("staticShapes")
        self._set("staticShapes", static_shapes=check_flag(enabled, method="Options.staticShapes", arg="enabled"))
        return self

    def autoOutline(self, enabled: bool = True) -> Options:  # noqa: N802
        """ipuxl extension: outline repeated blocks automatically (default: True).

        Structurally identical regions of the captured forward, backward and update
        (e.g. N identical transformer or MLP blocks) become calls of one shared graph,
        so their code exists once on the device (``ipuxl.passes.outline``). Results
        are unchanged; False keeps every op inline."""
        self._check_not_frozen("autoOutline")
        self._set("autoOutline", auto_outline=check_flag(enabled, method="Options.autoOutline", arg="enabled"))
        return self

    # -- attaching, execution strategy, compile messages (honoured) -------------------
    def connectionType(self, connection_type: ConnectionType) -> Options:  # noqa: N802
        """When to attach to the device (:class:`~ipuxl.poptorch_compat.enums.ConnectionType`):
        with ``Never`` the model compiles but never attaches, and running it raises
        (``runtime.connection``)."""
        self._check_not_frozen("connectionType")
        value = check_enum(connection_type, ConnectionType, method="Options.connectionType", arg="connection_type")
        self._set("connectionType", connection_type=value)
        return self

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> Options:  # noqa: N802
        """Compile for an IPU version without attaching (sets ``ConnectionType.Never``;
        the version is recorded, with no effect on a simulated device)."""
        self._check_not_frozen("useOfflineIpuTarget")
        version = check_positive_int(ipu_version, method="Options.useOfflineIpuTarget", arg="ipu_version",
                                     example="2")
        self.connectionType(ConnectionType.Never)
        self._set("useOfflineIpuTarget", ipu_version=version)
        return self

    def setExecutionStrategy(self, strategy: object) -> Options:  # noqa: N802
        """How blocks map to stages and IPUs (``PipelinedExecution``, ``ShardedExecution``,
        ``SerialPhasedExecution``, ``ParallelPhasedExecution``; see ``poptorch_compat.blocks``:
        captured ops carry their stage's IPU, the report shows the pipeline schedule)."""
        self._check_not_frozen("setExecutionStrategy")
        if not callable(getattr(strategy, "backendOptions", None)):
            raise OptionsError(f"Options.setExecutionStrategy: strategy must be an execution strategy "
                               f"(poptorch.PipelinedExecution, ShardedExecution...), got {strategy!r}",
                               where=user_source_line(), fix="pass e.g. poptorch.ShardedExecution()")
        self._execution_strategy = strategy
        return self

    def showCompilationProgressBar(self, show: bool = True) -> Options:  # noqa: N802
        """Show PopTorch's "Graph compilation" progress bar while the model compiles (default
        True, as upstream): shown only when stderr is a terminal, the compile takes more than
        about a second and ``IPUXL_PROGRESS`` is not ``0`` (``ipuxl.progress``)."""
        return self._record_flag("showCompilationProgressBar", "show_compilation_progress_bar", show, "show")

    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> Options:  # noqa: N802
        """Log unexpected optimiser attributes in ``setOptimizer`` at debug level instead of
        warning (recorded as :attr:`relax_optimizer_attributes_checks`)."""
        return self._record_flag("relaxOptimizerAttributesChecks", "relax_optimizer_attributes_checks", relax, "relax")

    # -- options files -------------------------------------------------------------
    def loadFromFile(self, filepath: str) -> Options:  # noqa: N802
        """Apply an options file: one setter call per line without the ``options.``
        prefix (``deviceIterations(4)``, ``Training.gradientAccumulation(2)``,
        ``outputMode(poptorch.OutputMode.All)``); blank lines and ``#`` comments skipped.

        Raises:
            ConfigFileError: a line is not valid Python (line number and text given).
        """
        import ipuxl.poptorch_compat as poptorch  # the namespace the file's lines see

        path = check_str(filepath, method="Options.loadFromFile", arg="filepath", example='"poptorch.conf"')
        with open(path) as handle:
            lines = [(n, line.strip()) for n, line in enumerate(handle, 1)]
        for number, line in lines:
            if not line or line.startswith("#"):
                continue
            try:
                code = compile(f"options.{line}", path, "eval")
            except SyntaxError as error:
                raise ConfigFileError(f"Options.loadFromFile: line {number} of {os.path.basename(path)} is not a "
                                      f"valid setter call ({error.msg}): {line!r}", where=f"{path}:{number}",
                                      fix="write one call per line, e.g. deviceIterations(4)") from None
            eval(code, {"poptorch": poptorch, "options": self})  # noqa: S307 - upstream runs the file too
        return self

    # -- what the compiler reads ----------------------------------------------------
    @property
    def auto_outline(self) -> bool:
        return bool(self._values["auto_outline"])

    @property
    def device_iterations(self) -> int:
        return int(self._values["device_iterations"])

    @property
    def replication_factor(self) -> int:
        return int(self._values["replication_factor"])

    @property
    def gradient_accumulation(self) -> int:
        """Same as ``opts.Training.gradient_accumulation``."""
        return self._training.gradient_accumulation

    @property
    def output_mode(self) -> OutputMode:
        """The output mode as set (possibly ``OutputMode.Default``; see
        :meth:`resolved_output_mode`)."""
        return OutputMode(self._values["output_mode"])

    @property
    def output_return_period(self) -> int:
        """N for ``OutputMode.EveryN``; 1 for the other modes."""
        return int(self._values["output_return_period"])

    anchor_mode = output_mode
    anchor_return_period = output_return_period

    @property
    def random_seed(self) -> int | None:
        """The seed given to :meth:`randomSeed`, or None when none was given."""
        return self._values.get("random_seed")

    @property
    def use_ipu_model(self) -> bool:
        return bool(self._values["use_model"])

    @property
    def static_shapes(self) -> bool:
        return bool(self._values["static_shapes"])

    @property
    def connection_type(self) -> ConnectionType:
        """``connectionType``'s value (default ``ConnectionType.Always``)."""
        return ConnectionType(self._values["connection_type"])

    @property
    def input_group_size(self) -> int:
        """``inputReplicaGrouping``'s group size: replicas in a group share one input batch."""
        return int(self._values["input_group_size"])

    @property
    def input_group_type(self) -> CommGroupType:
        """``inputReplicaGrouping``'s group type (default ``CommGroupType.Consecutive``)."""
        return CommGroupType(self._values["input_cgt"])

    @property
    def execution_strategy(self) -> object:
        """The strategy given to ``setExecutionStrategy`` (default: a ``PipelinedExecution()``, as upstream)."""
        return self._execution_strategy

    @property
    def device_type(self) -> Literal["ipu_model", "ipu_hw"]:
        """``"ipu_model"`` after ``useIpuModel(True)``, else ``"ipu_hw"``."""
        return "ipu_model" if self.use_ipu_model else "ipu_hw"

    def resolved_output_mode(self, training: bool) -> OutputMode:
        """The output mode a model uses: ``Default`` becomes ``Final`` for training and
        ``All`` for inference (upstream's defaults); other modes are kept."""
        training = self._training_flag(training, "resolved_output_mode")
        if self.output_mode is OutputMode.Default:
            return OutputMode.Final if training else OutputMode.All
        return self.output_mode

    def replicas_per_process(self) -> int:
        """The replicas this process runs and feeds: ``replication_factor`` (upstream's
        ``replicationFactor`` is per process)."""
        return self.replication_factor

    def total_replicas(self) -> int:
        """The replicas of the whole program: ``replication_factor x Distributed.numProcesses``."""
        return self.replication_factor * self._distributed.numProcesses

    def combined_batch_factor(self, training: bool) -> int:
        """Micro-batches consumed by one run of the model: deviceIterations x
        gradientAccumulation (training only) x replicationFactor. For inference, calls
        :meth:`check_inference_accumulation` first."""
        training = self._training_flag(training, "combined_batch_factor")
        if not training:
            self.check_inference_accumulation()
        accumulation = self._training.gradient_accumulation
        factor = self.device_iterations * self.replication_factor
        return factor * accumulation if training else factor

    def check_inference_accumulation(self) -> None:
        """Raise :class:`~ipuxl.errors.InferenceOptionsError` (a ``poptorch.Error``) with upstream's
        message for inference with ``Training.gradientAccumulation`` other than 1 (the advice on
        ``deviceIterations`` is added under a pipelined, not sharded, strategy)."""
        accumulation = self._training.gradient_accumulation
        if accumulation == 1:
            return
        message = ("You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as its default "
                   "value (1) when running a poptorch.inferenceModel().")
        strategy = self._execution_strategy
        if isinstance(strategy, PipelinedExecution) and not isinstance(strategy, ShardedExecution):
            message += (" Use poptorch.Options().deviceIterations to process a sufficient number of batches each run "
                        "for pipelined execution instead.")
        raise InferenceOptionsError(
            f"{message} (it is {accumulation}: gradient accumulation only applies to training)",
            where=user_source_line(),
            fix="use options with opts.Training.gradientAccumulation(1) for inference (for example "
                "`infer_opts = opts.clone(); infer_opts.Training.gradientAccumulation(1)`)")

    @staticmethod
    def _training_flag(training: object, method: str) -> bool:
        if not isinstance(training, bool):
            raise InvalidArgumentError(
                f"Options.{method}: training must be True or False, got {training!r} ({type_name(training)})",
                where=user_source_line(), fix=f"call opts.{method}(training=True) or (training=False)")
        return training

    def to_dict(self) -> dict[str, Any]:
        """The values the compiled program depends on, by ipuxl's names (for logs and
        compilation cache keys); :meth:`toDict` has every option."""
        return {
            "device_iterations": self.device_iterations,
            "replication_factor": self.replication_factor,
            "gradient_accumulation": self.gradient_accumulation,
            "output_mode": self.output_mode,
            "output_return_period": self.output_return_period,
            "random_seed": self.random_seed,
            "use_ipu_model": self.use_ipu_model,
            "static_shapes": self.static_shapes,
        }

    def toDict(self) -> dict[str, Any]:  # noqa: N802 - PopTorch's name
        """Every option as one flat dict under upstream's keys: this object's values, the
        sub-objects' (``Training``, ``Distributed``, ``Precision``, ``Jit``,
        ``TensorLocations``) and ``_Popart``'s PopART options. Unlike upstream, it does not
        require an output mode other than ``Default``."""
        merged = dict(self._popart.toDict())
        for group in (self._training, self._distributed, self._precision, self._jit, self._tensor_locations):
            merged.update(group.toDict())
        merged.update(super().toDict())
        return merged

    def __repr__(self) -> str:
        core, defaults = self.to_dict(), pristine_options().toDict()
        others = {k: v for k, v in self.toDict().items()
                  if k not in core and k != "use_model" and (k not in defaults or defaults[k] != v)}
        fields = {**core, **others, "frozen": self._frozen}
        body = ", ".join(f"{k}={_shown(v)}" for k, v in fields.items())
        return f"{type(self).__name__}({body})"


def _shown(value: Any) -> str:
    return f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else repr(value)
