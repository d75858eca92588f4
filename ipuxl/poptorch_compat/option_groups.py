"""The sub-objects of PopTorch's ``Options`` (``opts.Training``, ``opts.Precision``,
``opts.Distributed``, ``opts.Jit``, ``opts.TensorLocations``, ``opts._Popart``) and
``TensorLocationSettings``, with the argument checks they share.

Upstream names these ``poptorch.options._TrainingOptions`` etc.; ``options`` exports
them under those names. Each group keeps its values in a dict under upstream's keys
(``toDict()``), refuses changes once its ``Options`` are frozen and refuses attribute
assignment in favour of its setters. What each value does on the simulated device is
said in the setter's docstring and in ``docs/poptorch.md``.
"""
from __future__ import annotations

import copy
import enum
import numbers
import os
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ipuxl.errors import FrozenOptionsError, OptionsError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.enums import HalfFloatCastingBehavior, MeanReductionStrategy, ReductionType

if TYPE_CHECKING:
    from ipuxl.poptorch_compat.options import Options

__all__ = [
    "DistributedOptions", "JitOptions", "OptionGroup", "PopartOptions", "PrecisionOptions", "TensorLocationOptions",
    "TensorLocationSettings", "TrainingOptions", "check_enum", "check_flag", "check_int", "check_positive_int",
    "type_name", "check_str"]

E = TypeVar("E", bound=enum.Enum)


# -- argument checks (each raises OptionsError: a ValueError and an AssertionError) --
def type_name(value: object) -> str:
    return type(value).__name__


def check_int(value: object, *, method: str, arg: str, example: str) -> int:
    """``value`` as an ``int`` (not a bool), else an :class:`OptionsError` naming ``method``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionsError(f"{method}: {arg} must be an int, got {value!r} ({type_name(value)})",
                           where=user_source_line(), fix=f"pass a whole number, for example {example}")
    return int(value)


def check_positive_int(value: object, *, method: str, arg: str, example: str) -> int:
    """``value`` as an ``int`` >= 1, or an :class:`OptionsError` naming ``method``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionsError(
            f"{method}: {arg} must be a positive int, got {value!r} ({type_name(value)})",
            where=user_source_line(), fix=f"pass a whole number >= 1, for example {example}")
    if value < 1:
        raise OptionsError(
            f"{method}: {arg} must be a positive int (>= 1), got {value}",
            where=user_source_line(), fix=f"pass a whole number >= 1, for example {example}")
    return int(value)


def check_flag(value: object, *, method: str, arg: str) -> bool:
    """``value`` if it is a ``bool``, else an :class:`OptionsError` naming ``method``."""
    if not isinstance(value, bool):
        raise OptionsError(
            f"{method}: {arg} must be True or False, got {value!r} ({type_name(value)})",
            where=user_source_line(), fix=f"call {method}(True) or {method}(False)")
    return value


def check_enum(value: object, cls: type[E], *, method: str, arg: str, allowed: tuple[E, ...] | None = None) -> E:
    """``value`` if it is one of ``allowed`` (default: any member of ``cls``)."""
    members = allowed if allowed is not None else tuple(cls)
    names = ", ".join(f"poptorch.{cls.__name__}.{m.name}" for m in members)
    if not isinstance(value, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise OptionsError(f"{method}: {arg} must be {article} {cls.__name__}, got {value!r} ({type_name(value)})",
                           where=user_source_line(), fix=f"pass one of {names}")
    if value not in members:
        raise OptionsError(f"{method}: {arg} must be one of {names}, got {cls.__name__}.{value.name}",
                           where=user_source_line(), fix=f"pass one of {names}")
    return value


def check_str(value: object, *, method: str, arg: str, example: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise OptionsError(f"{method}: {arg} must be a string, got {value!r} ({type_name(value)})",
                           where=user_source_line(), fix=f"pass a string, for example {example}")
    return str(os.fspath(value))


class OptionGroup:
    """Shared plumbing: values in a dict under upstream's keys, a frozen check, no public
    attribute assignment, ``exists``/``toDict``/``__repr__`` and read access to values
    by key (``opts.Training.gradient_accumulation``), as upstream's ``OptionsDict``."""

    _path = "Options"
    _upstream_name = "Options"
    _always_shown: tuple[str, ...] = ()  # keys __repr__ shows even at their default

    def __init__(self, owner: Options | None, **defaults: Any) -> None:
        self._owner = owner
        self._values: dict[str, Any] = dict(defaults)
        self._defaults: dict[str, Any] = copy.deepcopy(defaults)

    #: option key -> the setter an assignment ``group.key = value`` calls (its checks apply)
    _ASSIGNED_BY: dict[str, str] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        self._assign(name, value)

    def _assign(self, name: str, value: Any) -> None:
        """``group.key = value`` sets option ``key``, as upstream's ``OptionsDict`` does: through
        its setter when it has one, else stored if of the same type as the current value.
        A name that is not an option is refused (no attribute is created)."""
        setter = self._ASSIGNED_BY.get(name)
        if setter is not None:
            getattr(self, setter)(value)
            return
        values = self.__dict__.get("_values")
        if values is None or name not in values:
            raise OptionsError(f"{self._path}.{name} cannot be assigned: it is not an option of {self._path}",
                               where=user_source_line(), fix=self._setter_hint(name))
        self._check_not_frozen(name)
        current = values[name]
        if isinstance(current, enum.Enum) and not isinstance(value, enum.Enum) and isinstance(value, int) \
                and value in {m.value for m in type(current)}:
            value = type(current)(value)
        if current is not None and not isinstance(value, type(current)):
            raise OptionsError(f"Unexpected type {type_name(value)} for option {name} of {self._path}. "
                               f"Expected {type_name(current)}", where=user_source_line(),
                               fix=self._setter_hint(name))
        values[name] = value

    def _setter_hint(self, name: str) -> str:
        return f"see help({self._path}) for the available setters"

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values")
        if name.startswith("_") or values is None or name not in values:
            raise AttributeError(f"'{self._upstream_name}' has no option or attribute '{name}'")
        return values[name]

    def _is_frozen_now(self) -> bool:
        return self._owner is not None and self._owner.frozen

    def _check_not_frozen(self, method: str) -> None:
        if self._is_frozen_now():
            raise FrozenOptionsError(
                f"cannot change {self._path}.{method}(): these Options are frozen because a model "
                "was compiled with them (or an ipuxl.DataLoader was built from them)",
                where=user_source_line(),
                fix="make an unfrozen copy with `opts = opts.clone()`, change the copy and pass it to "
                    "the new model or DataLoader (or start from a new ipuxl.Options())")

    def _set(self, method: str, **values: Any) -> None:
        """Store ``values`` (after the frozen check; arguments are checked by the caller)."""
        self._check_not_frozen(method)
        self._values.update(values)

    def exists(self, option: str) -> bool:
        """Whether ``option`` has a value (upstream's ``OptionsDict.exists``)."""
        return option in self._values

    def toDict(self) -> dict[str, Any]:  # noqa: N802 - PopTorch's name
        """The values under upstream's keys (a copy)."""
        return {k: _copied(v) for k, v in self._values.items()}

    def __repr__(self) -> str:
        shown = {k: v for k, v in self._values.items()
                 if k in self._always_shown or k not in self._defaults or self._defaults[k] != v}
        return f"{self._upstream_name}(" + ", ".join(f"{k}={_show(v)}" for k, v in shown.items()) + ")"


def _copied(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return list(value) if isinstance(value, list) else value


def _show(value: Any) -> str:
    return f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else repr(value)


class PopartOptions(OptionGroup):
    """``opts._Popart``: PopART session options by PopART's names (``set(key, value)``).

    Recorded and shown by ``toDict()``; ipuxl has no PopART, so a key has no effect on
    the simulated device unless another setter that writes it says so."""

    _path = "Options._Popart"
    _upstream_name = "_PopartOptions"

    def __init__(self, owner: Options | None) -> None:
        super().__init__(owner, instrumentWithHardwareCycleCounter=False, rearrangeAnchorsOnHost=False)

    @property
    def options(self) -> dict[str, Any]:
        """The PopART options set so far (upstream's ``_Popart.options``)."""
        return self._values

    def set(self, key: str, value: Any) -> PopartOptions:
        """Set PopART session option ``key`` to ``value``."""
        self._check_not_frozen("set")
        check_str(key, method="Options._Popart.set", arg="key", example='"autoRecomputation"')
        self._set("set", **{key: value})
        return self

    def setEngineOptions(self, engine_options: dict[str, str]) -> PopartOptions:  # noqa: N802
        """Set Poplar engine options (no effect on a simulated device)."""
        self._check_not_frozen("setEngineOptions")
        if not isinstance(engine_options, dict):
            raise OptionsError(f"Options._Popart.setEngineOptions: engine_options must be a dict, got "
                               f"{type_name(engine_options)}", where=user_source_line(),
                               fix='pass a dict, e.g. {"autoReport.all": "true"}')
        return self.set("engineOptions", dict(engine_options))

    def setPatterns(self, patterns: dict[str, bool], level: int = 2) -> PopartOptions:  # noqa: N802
        """Enable or disable PopART patterns by name (no effect on a simulated device)."""
        self._check_not_frozen("setPatterns")
        level = check_int(level, method="Options._Popart.setPatterns", arg="level", example="2")
        if not isinstance(patterns, dict):
            raise OptionsError(f"Options._Popart.setPatterns: patterns must be a dict of name -> bool, got "
                               f"{type_name(patterns)}", where=user_source_line(),
                               fix='pass e.g. {"OpToIdentity": True}')
        self._set("setPatterns", patterns_level=level, patterns=dict(patterns))
        return self


class JitOptions(OptionGroup):
    """``opts.Jit``: upstream chose torch.jit tracing or the dispatcher. ipuxl always
    captures with ``make_fx`` (the dispatcher), so ``traceModel`` has no effect."""

    _path = "Options.Jit"
    _upstream_name = "_JitOptions"
    _ASSIGNED_BY = {"trace_model": "traceModel"}

    def __init__(self, owner: Options | None) -> None:
        super().__init__(owner, trace_model=True)

    def traceModel(self, trace_model: bool) -> JitOptions:  # noqa: N802
        """Recorded; no effect (ipuxl captures through the dispatcher)."""
        self._check_not_frozen("traceModel")
        self._set("traceModel", trace_model=check_flag(trace_model, method="Options.Jit.traceModel",
                                                          arg="trace_model"))
        return self


class PrecisionOptions(OptionGroup):
    """``opts.Precision``: float16 handling. Values are recorded (``half_float_casting``,
    ``running_statistics_always_float``, :attr:`partials_type`) for the compile path;
    the PopART ones (floating-point exceptions, stochastic rounding, partials) are also
    written to ``opts._Popart`` under PopART's names, as upstream does."""

    _path = "Options.Precision"
    _upstream_name = "_PrecisionOptions"
    _ASSIGNED_BY = {"half_float_casting": "halfFloatCasting",
                    "running_statistics_always_float": "runningStatisticsAlwaysFloat"}

    def __init__(self, owner: Options | None, popart: PopartOptions) -> None:
        super().__init__(owner, half_float_casting=HalfFloatCastingBehavior.Default,
                         running_statistics_always_float=True)
        self._popart = popart

    def halfFloatCasting(self, half_float_casting: HalfFloatCastingBehavior) -> PrecisionOptions:  # noqa: N802
        """How ops mixing float16 and float32 inputs cast them (see
        :class:`~ipuxl.poptorch_compat.enums.HalfFloatCastingBehavior`)."""
        self._check_not_frozen("halfFloatCasting")
        value = check_enum(half_float_casting, HalfFloatCastingBehavior, method="Options.Precision.halfFloatCasting",
                           arg="half_float_casting")
        self._set("halfFloatCasting", half_float_casting=value)
        return self

    def runningStatisticsAlwaysFloat(self, value: bool) -> PrecisionOptions:  # noqa: N802
        """Keep batch-norm running mean and variance in float32 for float16 models (default True)."""
        self._check_not_frozen("runningStatisticsAlwaysFloat")
        value = check_flag(value, method="Options.Precision.runningStatisticsAlwaysFloat", arg="value")
        self._set("runningStatisticsAlwaysFloat", running_statistics_always_float=value)
        return self

    @property
    def floating_point_exceptions(self) -> tuple[bool, dict[str, str]]:
        """PopART's ``enableFloatingPointChecks`` and the engine options (``device.fp_checks``)."""
        return bool((o := self._popart.options).get("enableFloatingPointChecks")), dict(o.get("engineOptions", {}))

    def enableFloatingPointExceptions(self, enabled: bool) -> PrecisionOptions:  # noqa: N802
        """Stop a step at an IPU floating-point exception (checked around each op: ``device.fp_checks``)."""
        self._check_not_frozen("enableFloatingPointExceptions")
        enabled = check_flag(enabled, method="Options.Precision.enableFloatingPointExceptions", arg="enabled")
        self._popart.set("enableFloatingPointChecks", enabled)
        return self

    def enableStochasticRounding(self, enabled: bool) -> PrecisionOptions:  # noqa: N802
        """Stochastic rounding of float16 results (recorded; no effect: torch rounds to nearest)."""
        self._check_not_frozen("enableStochasticRounding")
        enabled = check_flag(enabled, method="Options.Precision.enableStochasticRounding", arg="enabled")
        self._popart.set("enableStochasticRounding", enabled)
        return self

    def setPartialsType(self, dtype: torch.dtype) -> PrecisionOptions:  # noqa: N802
        """The dtype of matmul and convolution partial sums: ``torch.float`` or ``torch.half``."""
        self._check_not_frozen("setPartialsType")
        if dtype not in (torch.float32, torch.float16):
            raise OptionsError(f"Options.Precision.setPartialsType: dtype must be torch.float or torch.half, "
                               f"got {dtype!r}", where=user_source_line(),
                               fix="call opts.Precision.setPartialsType(torch.half) (or torch.float)")
        self._check_not_frozen("setPartialsType")
        name = "float" if dtype == torch.float32 else "half"
        self._popart.set("partialsTypeMatMuls", name)
        conv = dict(self._popart.options.get("convolutionOptions", {}))
        self._popart.set("convolutionOptions", {**conv, "partialsType": name})
        return self

    @property
    def partials_type(self) -> torch.dtype:
        """``torch.float16`` after ``setPartialsType(torch.half)``, else ``torch.float32``."""
        return torch.float16 if self._popart.options.get("partialsTypeMatMuls") == "half" else torch.float32


class TrainingOptions(OptionGroup):
    """``opts.Training``: options of training models (``gradientAccumulation``, how
    accumulated and replicated gradients are reduced...)."""

    _path = "Options.Training"
    _upstream_name = "_TrainingOptions"
    _ASSIGNED_BY = {"gradient_accumulation": "gradientAccumulation",
                    "accumulation_and_replication_reduction_type": "accumulationAndReplicationReductionType",
                    "meanAccumulationAndReplicationReductionStrategy":
                        "setMeanAccumulationAndReplicationReductionStrategy"}
    _always_shown = ("gradient_accumulation",)

    def __init__(self, owner: Options | None, popart: PopartOptions) -> None:
        super().__init__(owner, gradient_accumulation=1,
                         accumulation_and_replication_reduction_type=ReductionType.Mean,
                         meanAccumulationAndReplicationReductionStrategy=MeanReductionStrategy.Post)
        self._popart = popart

    def _setter_hint(self, name: str) -> str:
        if name == "gradient_accumulation":
            return "call opts.Training.gradientAccumulation(n)"
        return super()._setter_hint(name)

    def gradientAccumulation(self, gradient_accumulation: int) -> TrainingOptions:  # noqa: N802
        """Micro-batches whose gradients are accumulated before each optimiser step
        (default 1; must stay 1 for inference)."""
        self._check_not_frozen("gradientAccumulation")
        value = check_positive_int(gradient_accumulation, method="Options.Training.gradientAccumulation",
                                   arg="gradient_accumulation", example="opts.Training.gradientAccumulation(4)")
        self._set("gradientAccumulation", gradient_accumulation=value)
        return self

    def accumulationAndReplicationReductionType(self, reduction_type: ReductionType) -> TrainingOptions:  # noqa: N802
        """Whether accumulated and replicated gradients are averaged (``Mean``, default) or
        summed (``Sum``) before the optimiser step."""
        self._check_not_frozen("accumulationAndReplicationReductionType")
        value = check_enum(reduction_type, ReductionType,
                           method="Options.Training.accumulationAndReplicationReductionType", arg="reduction_type",
                           allowed=(ReductionType.Mean, ReductionType.Sum))
        self._set("accumulationAndReplicationReductionType", accumulation_and_replication_reduction_type=value)
        return self

    def setMeanAccumulationAndReplicationReductionStrategy(  # noqa: N802
            self, mean_reduction_strategy: MeanReductionStrategy) -> TrainingOptions:
        """When a ``Mean`` reduction divides (``Post``, default, or ``Running``): the same
        values up to rounding."""
        self._check_not_frozen("setMeanAccumulationAndReplicationReductionStrategy")
        value = check_enum(mean_reduction_strategy, MeanReductionStrategy,
                           method="Options.Training.setMeanAccumulationAndReplicationReductionStrategy",
                           arg="mean_reduction_strategy")
        self._set("setMeanAccumulationAndReplicationReductionStrategy",
                  meanAccumulationAndReplicationReductionStrategy=value)
        return self

    def setAutomaticLossScaling(self, enabled: bool) -> TrainingOptions:  # noqa: N802
        """PopART's automatic loss scaling (recorded in ``_Popart``; no effect: ipuxl
        computes gradients in the model's dtype without a loss scale)."""
        self._check_not_frozen("setAutomaticLossScaling")
        enabled = check_flag(enabled, method="Options.Training.setAutomaticLossScaling", arg="enabled")
        self._popart.set("automaticLossScalingSettings.enabled", enabled)
        return self

    def setConvolutionDithering(self, enabled: bool) -> TrainingOptions:  # noqa: N802
        """Tile placement of convolutions (recorded in ``_Popart``; no effect on a simulated device)."""
        self._check_not_frozen("setConvolutionDithering")
        enabled = check_flag(enabled, method="Options.Training.setConvolutionDithering", arg="enabled")
        conv = dict(self._popart.options.get("convolutionOptions", {}))
        self._popart.set("convolutionOptions", {**conv, "enableConvDithering": enabled})
        return self

    @property
    def gradient_accumulation(self) -> int:
        """The gradient accumulation factor (read-only; set it with ``gradientAccumulation``)."""
        return int(self._values["gradient_accumulation"])


class TensorLocationSettings(OptionGroup):
    """Where one kind of tensor is stored (``poptorch.TensorLocationSettings``), passed to
    ``opts.TensorLocations.set*Location``. Honoured by the resource model for weights and
    optimiser state (off-chip tensors are counted in Streaming Memory with their per-step
    traffic, sharded ones per replica: ``poptorch_compat.compile.locations``); values are unchanged."""

    _path = "TensorLocationSettings"
    _upstream_name = "TensorLocationSettings"

    def __init__(self) -> None:
        super().__init__(None)

    def minElementsForOffChip(self, min_elements: int) -> TensorLocationSettings:  # noqa: N802
        """Tensors with fewer elements stay on chip."""
        value = check_int(min_elements, method="TensorLocationSettings.minElementsForOffChip",
                          arg="min_elements", example="1024")
        self._set("minElementsForOffChip", minElementsForOffChip=value)
        return self

    def minElementsForReplicatedTensorSharding(self, min_elements: int) -> TensorLocationSettings:  # noqa: N802
        """Only tensors with more elements are sharded over replicas."""
        value = check_int(min_elements, method="TensorLocationSettings.minElementsForReplicatedTensorSharding",
                          arg="min_elements", example="1024")
        self._set("minElementsForReplicatedTensorSharding", minElementsForReplicatedTensorSharding=value)
        return self

    def useOnChipStorage(self, use: bool | None = True) -> TensorLocationSettings:  # noqa: N802
        """On-chip (True) or off-chip (False) storage; None leaves it undecided."""
        if use is None:
            self._values.pop("onChip", None)
            return self
        self._set("useOnChipStorage", onChip=int(check_flag(use, method="TensorLocationSettings.useOnChipStorage",
                                                             arg="use")))
        return self

    def useReplicatedTensorSharding(self, use: bool = True) -> TensorLocationSettings:  # noqa: N802
        """Shard the tensors over the replicas (weights and optimiser state)."""
        flag = check_flag(use, method="TensorLocationSettings.useReplicatedTensorSharding", arg="use")
        self._set("useReplicatedTensorSharding", useReplicatedTensorSharding=int(flag))
        return self

    def useIOTilesToLoad(self, use: bool = True) -> TensorLocationSettings:  # noqa: N802
        """Load the tensors through IO tiles."""
        flag = check_flag(use, method="TensorLocationSettings.useIOTilesToLoad", arg="use")
        self._set("useIOTilesToLoad", useIOTilesToLoad=int(flag))
        return self

    def useIOTilesToStore(self, use: bool = True) -> TensorLocationSettings:  # noqa: N802
        """Store the tensors through IO tiles."""
        flag = check_flag(use, method="TensorLocationSettings.useIOTilesToStore", arg="use")
        self._set("useIOTilesToStore", useIOTilesToStore=int(flag))
        return self


class TensorLocationOptions(OptionGroup):
    """``opts.TensorLocations``: where activations, weights, optimiser state and
    accumulators live, and how many IO tiles there are. Recorded (``toDict()``); weight and
    optimiser locations are honoured in the resource model (``poptorch_compat.compile.locations``),
    activation and accumulator locations and IO tiles have no effect on the simulated device."""

    _path = "Options.TensorLocations"
    _upstream_name = "_TensorLocationOptions"

    def numIOTiles(self, num_tiles: int) -> TensorLocationOptions:  # noqa: N802
        """Tiles reserved for IO: an even number in [32, 192]."""
        self._check_not_frozen("numIOTiles")
        value = check_int(num_tiles, method="Options.TensorLocations.numIOTiles", arg="num_tiles", example="32")
        if not (32 <= value <= 192 and value % 2 == 0):
            raise OptionsError(f"numIOTiles must be an even number between 32 and 192. (Options.TensorLocations."
                               f"numIOTiles got {value})", where=user_source_line(), fix="pass e.g. 32 or 64")
        self._set("numIOTiles", numIOTiles=value)
        return self

    def _location(self, method: str, key: str, location: object) -> TensorLocationOptions:
        self._check_not_frozen(method)
        if not isinstance(location, TensorLocationSettings):
            raise OptionsError(f"Options.TensorLocations.{method}: location must be a poptorch.TensorLocationSettings, "
                               f"got {location!r} ({type_name(location)})", where=user_source_line(),
                               fix=f"call opts.TensorLocations.{method}(poptorch.TensorLocationSettings()"
                                   ".useOnChipStorage(False))")
        self._set(method, **{key: location.toDict()})
        return self

    def setActivationLocation(self, location: TensorLocationSettings) -> TensorLocationOptions:  # noqa: N802
        """Where activations are stored."""
        return self._location("setActivationLocation", "location_activation", location)

    def setWeightLocation(self, location: TensorLocationSettings) -> TensorLocationOptions:  # noqa: N802
        """Where weights are stored."""
        return self._location("setWeightLocation", "location_weight", location)

    def setOptimizerLocation(self, location: TensorLocationSettings) -> TensorLocationOptions:  # noqa: N802
        """Where optimiser state is stored."""
        return self._location("setOptimizerLocation", "location_optimizer", location)

    def setAccumulatorLocation(self, location: TensorLocationSettings) -> TensorLocationOptions:  # noqa: N802
        """Where gradient accumulators are stored."""
        return self._location("setAccumulatorLocation", "location_accumulator", location)


class DistributedOptions(OptionGroup):
    """``opts.Distributed``: which of several host processes this one is (upstream's
    ``_DistributedOptions``). Honoured: ``ipuxl.DataLoader`` reads this process's shard
    and each process runs ``replicationFactor`` replicas (as upstream).

    Until ``configureProcessId`` (or ``setEnvVarNames`` / ``disable``) is called, the
    values come from torchrun's ``RANK`` and ``WORLD_SIZE`` environment variables, read
    when asked for (1 process when unset); upstream reads OpenMPI's by default.
    """

    _path = "Options.Distributed"
    _upstream_name = "_DistributedOptions"
    _DEFAULT_ENV = ("WORLD_SIZE", "RANK")

    def __init__(self, owner: Options | None) -> None:
        super().__init__(owner)
        self._configured: tuple[int, int] | None = None  # (process_id, num_processes)

    def configureProcessId(self, process_id: int, num_processes: int) -> DistributedOptions:  # noqa: N802
        """Set this process's id (0-based) and the number of processes of the run."""
        self._check_not_frozen("configureProcessId")
        count = check_positive_int(num_processes, method="Options.Distributed.configureProcessId",
                                   arg="num_processes", example="opts.Distributed.configureProcessId(0, 2)")
        if isinstance(process_id, bool) or not isinstance(process_id, numbers.Integral) \
                or not 0 <= process_id < count:
            raise OptionsError(
                f"Options.Distributed.configureProcessId: process_id must be an int in [0, {count}) "
                f"for {count} processes, got {process_id!r}", where=user_source_line(),
                fix=f"pass this process's index among the {count}, e.g. "
                    f"opts.Distributed.configureProcessId(0, {count})")
        self._configured = (int(process_id), count)
        return self

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str) -> DistributedOptions:  # noqa: N802
        """Read the process count and id now from these environment variables
        (e.g. ``"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"`` under mpirun)."""
        self._check_not_frozen("setEnvVarNames")
        count, pid = read_process_env(var_num_processes, var_process_id, "Options.Distributed.setEnvVarNames")
        return self.configureProcessId(pid, count)

    def disable(self) -> DistributedOptions:
        """Run as a single process, whatever the environment says."""
        self._check_not_frozen("disable")
        self._configured = (0, 1)
        return self

    @property
    def processId(self) -> int:  # noqa: N802 - PopTorch's name
        """The id of this process (0 when not distributed)."""
        return self._process_values()[0]

    @property
    def numProcesses(self) -> int:  # noqa: N802 - PopTorch's name
        """The number of processes the run is split over (1 when not distributed)."""
        return self._process_values()[1]

    @property
    def distributed_process_id(self) -> int:
        """Upstream's key for :attr:`processId` (``toDict()``'s ``distributed_process_id``)."""
        return self._process_values()[0]

    @property
    def num_distributed_processes(self) -> int:
        """Upstream's key for :attr:`numProcesses` (``toDict()``'s ``num_distributed_processes``)."""
        return self._process_values()[1]

    @property
    def configured(self) -> bool:
        """True when set explicitly (``configureProcessId`` etc.), not read from torchrun's environment."""
        return self._configured is not None

    def _process_values(self) -> tuple[int, int]:
        if self._configured is not None:
            return self._configured
        count, pid = read_process_env(*self._DEFAULT_ENV, "Options.Distributed")
        return pid, count

    def toDict(self) -> dict[str, Any]:  # noqa: N802
        pid, count = self._process_values()
        return {"distributed_process_id": pid, "num_distributed_processes": count}

    def __repr__(self) -> str:
        pid, count = self._process_values()
        return f"{self._upstream_name}(process_id={pid}, num_processes={count})"


def read_process_env(var_num_processes: str, var_process_id: str, method: str) -> tuple[int, int]:
    """(num_processes, process_id) from two environment variables (defaults 1 and 0)."""
    values = []
    for var, default in ((var_num_processes, "1"), (var_process_id, "0")):
        raw = os.environ.get(var, default)
        try:
            values.append(int(raw))
        except ValueError:
            raise OptionsError(f"{method}: environment variable {var}={raw!r} is not an integer",
                               where=user_source_line(), fix=f"unset {var} or set it to a whole number") from None
    count, pid = values
    if count < 1 or not 0 <= pid < count:
        raise OptionsError(f"{method}: process id {pid} ({var_process_id}) is not in [0, {count}) "
                           f"({var_num_processes}={count})", where=user_source_line(),
                           fix=f"set {var_num_processes} >= 1 and 0 <= {var_process_id} < {var_num_processes}")
    return count, pid
