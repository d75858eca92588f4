"""PopTorch-style ``Options``: how a model is batched, replicated and returns outputs.

This follows the public PopTorch API (``poptorch.Options`` in ``python/options.py``,
the freezing rules of ``OptionsDict`` in ``python/_options_impl.py`` and the enums
of ``python/enums.py``) for the options ipuxl implements:

* setters are camelCase and chainable (each returns the object it was called on):
  ``Options().deviceIterations(4).replicationFactor(2)``; training options live in
  the sub-object ``opts.Training`` (``opts.Training.gradientAccumulation(8)``);
* ``outputMode(OutputMode.EveryN, N)`` needs a positive period; a period given
  with another mode is ignored, as upstream does (ipuxl also warns about it);
* ``OutputMode.Default`` means ``Final`` for a training model and ``All`` for an
  inference model (``resolved_output_mode``);
* an inference model refuses ``Training.gradientAccumulation`` other than 1, as
  ``poptorch.inferenceModel`` does (``combined_batch_factor(training=False)``);
* ``randomSeed(seed)`` also seeds torch's host RNG (``torch.manual_seed``), as
  upstream does, so host-side shuffling is reproducible too;
* options freeze once a model is compiled with them (the compiler calls
  ``freeze()``, upstream ``_freeze()``; ``ipuxl.DataLoader`` freezes them too, as upstream's does);
  changing frozen options raises :class:`~ipuxl.errors.FrozenOptionsError`, and
  ``clone()`` returns an unfrozen deep copy.

* ``opts.Distributed.configureProcessId(process_id, num_processes)`` says which of
  several host processes this one is (upstream's ``_DistributedOptions``); without
  it the process id and count come from torchrun's ``RANK`` / ``WORLD_SIZE``
  environment variables (upstream reads OpenMPI's by default; ``setEnvVarNames``
  picks others). ``ipuxl.DataLoader`` then reads only this process's shard of the
  dataset. Unlike upstream, ``replicationFactor`` is the *global* number of
  replicas (upstream: replicas per process); each process runs R / num_processes.

ipuxl additions: ``staticShapes()`` (refuse to recompile when input shapes change),
read-only snake_case properties for the compiler (``device_iterations``...),
``device_type``, ``resolved_output_mode`` and ``combined_batch_factor``. Unlike
upstream, every value is validated up front and errors are ``ipuxl.errors``
classes saying what is wrong, where, and how to fix it; assigning an attribute
(``opts.device_iterations = 4``) is refused in favour of the setter methods.
"""
from __future__ import annotations

import copy
import enum
import numbers
import os
import warnings
from typing import Any, Literal

import torch

from ipuxl.errors import FrozenOptionsError, InvalidArgumentError, OptionsError
from ipuxl.ir.context import user_source_line

__all__ = ["AnchorMode", "Options", "OutputMode"]


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


def _type_name(value: object) -> str:
    return type(value).__name__


def _positive_int(value: object, *, method: str, arg: str, example: str) -> int:
    """``value`` as an ``int`` >= 1, or an :class:`OptionsError` naming ``method``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionsError(
            f"{method}: {arg} must be a positive int, got {value!r} ({_type_name(value)})",
            where=user_source_line(), fix=f"pass a whole number >= 1, for example {example}")
    if value < 1:
        raise OptionsError(
            f"{method}: {arg} must be a positive int (>= 1), got {value}",
            where=user_source_line(), fix=f"pass a whole number >= 1, for example {example}")
    return int(value)


def _flag(value: object, *, method: str, arg: str) -> bool:
    """``value`` if it is a ``bool``, else an :class:`OptionsError` naming ``method``."""
    if not isinstance(value, bool):
        raise OptionsError(
            f"{method}: {arg} must be True or False, got {value!r} ({_type_name(value)})",
            where=user_source_line(), fix=f"call {method}(True) or {method}(False)")
    return value


class _OptionGroup:
    """Shared plumbing: no public attribute assignment, and a frozen check."""

    _path = "Options"

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        setter = _SETTERS.get(name)
        raise OptionsError(
            f"{self._path}.{name} cannot be assigned: options are changed through their setter methods",
            where=user_source_line(),
            fix=f"call {setter}" if setter else f"see help({self._path}) for the available setters")

    def _is_frozen_now(self) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def _check_not_frozen(self, method: str) -> None:
        if self._is_frozen_now():
            raise FrozenOptionsError(
                f"cannot change {self._path}.{method}(): these Options are frozen because a model "
                "was compiled with them (or an ipuxl.DataLoader was built from them)",
                where=user_source_line(),
                fix="make an unfrozen copy with `opts = opts.clone()`, change the copy and pass it to "
                    "the new model or DataLoader (or start from a new ipuxl.Options())")


class _TrainingOptions(_OptionGroup):
    """Options specific to training, reached through :attr:`Options.Training`.

    >>> opts = Options()
    >>> opts.Training.gradientAccumulation(4)  # doctest: +ELLIPSIS
    _TrainingOptions(gradient_accumulation=4)
    """

    _path = "Options.Training"

    def __init__(self, owner: "Options") -> None:
        self._owner = owner
        self._gradient_accumulation = 1

    def _is_frozen_now(self) -> bool:
        return self._owner.frozen

    def gradientAccumulation(self, gradient_accumulation: int) -> "_TrainingOptions":
        """Number of micro-batches whose gradients are accumulated before each
        optimiser step (default: 1). It scales the number of samples consumed per
        run (see :meth:`Options.combined_batch_factor`); it must stay 1 for
        inference.
        """
        self._check_not_frozen("gradientAccumulation")
        self._gradient_accumulation = _positive_int(
            gradient_accumulation, method="Options.Training.gradientAccumulation",
            arg="gradient_accumulation", example="opts.Training.gradientAccumulation(4)")
        return self

    @property
    def gradient_accumulation(self) -> int:
        """The gradient accumulation factor (read-only; set it with ``gradientAccumulation``)."""
        return self._gradient_accumulation

    def __repr__(self) -> str:
        return f"{type(self).__name__}(gradient_accumulation={self._gradient_accumulation})"


class _DistributedOptions(_OptionGroup):
    """Options of a run split over several host processes, reached through
    :attr:`Options.Distributed` (upstream's ``poptorch.options._DistributedOptions``).

    >>> opts = Options()
    >>> opts.Distributed.configureProcessId(0, 2)  # doctest: +ELLIPSIS
    _DistributedOptions(process_id=0, num_processes=2)

    Until ``configureProcessId`` (or ``setEnvVarNames`` / ``disable``) is called, the
    values come from the environment variables ``RANK`` and ``WORLD_SIZE`` that
    ``torchrun`` sets, read when asked for (1 process when they are unset).
    """

    _path = "Options.Distributed"
    _DEFAULT_ENV = ("WORLD_SIZE", "RANK")

    def __init__(self, owner: "Options") -> None:
        self._owner = owner
        self._configured: tuple[int, int] | None = None  # (process_id, num_processes)

    def _is_frozen_now(self) -> bool:
        return self._owner.frozen

    def configureProcessId(self, process_id: int, num_processes: int) -> "_DistributedOptions":  # noqa: N802
        """Set this process's id (0-based) and the number of processes of the run."""
        self._check_not_frozen("configureProcessId")
        count = _positive_int(num_processes, method="Options.Distributed.configureProcessId",
                              arg="num_processes", example="opts.Distributed.configureProcessId(0, 2)")
        if isinstance(process_id, bool) or not isinstance(process_id, numbers.Integral) \
                or not 0 <= process_id < count:
            raise OptionsError(
                f"Options.Distributed.configureProcessId: process_id must be an int in [0, {count}) "
                f"for {count} processes, got {process_id!r}",
                where=user_source_line(),
                fix=f"pass this process's index among the {count}, e.g. "
                    f"opts.Distributed.configureProcessId(0, {count})")
        self._configured = (int(process_id), count)
        return self

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str) -> "_DistributedOptions":  # noqa: N802
        """Read the process count and id now from these environment variables
        (e.g. ``"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"`` under mpirun)."""
        self._check_not_frozen("setEnvVarNames")
        count, pid = _read_env(var_num_processes, var_process_id, "Options.Distributed.setEnvVarNames")
        return self.configureProcessId(pid, count)

    def disable(self) -> "_DistributedOptions":
        """Run as a single process, whatever the environment says."""
        self._check_not_frozen("disable")
        self._configured = (0, 1)
        return self

    @property
    def processId(self) -> int:  # noqa: N802 - PopTorch's name
        """The id of this process (0 when not distributed)."""
        return self._values()[0]

    @property
    def numProcesses(self) -> int:  # noqa: N802 - PopTorch's name
        """The number of processes the run is split over (1 when not distributed)."""
        return self._values()[1]

    @property
    def configured(self) -> bool:
        """True when set explicitly (``configureProcessId`` etc.), not read from torchrun's environment."""
        return self._configured is not None

    def _values(self) -> tuple[int, int]:
        if self._configured is not None:
            return self._configured
        count, pid = _read_env(*self._DEFAULT_ENV, "Options.Distributed")
        return pid, count

    def __repr__(self) -> str:
        pid, count = self._values()
        return f"{type(self).__name__}(process_id={pid}, num_processes={count})"


def _read_env(var_num_processes: str, var_process_id: str, method: str) -> tuple[int, int]:
    """(num_processes, process_id) from two environment variables (defaults 1 and 0)."""
    values = []
    for var, default in ((var_num_processes, "1"), (var_process_id, "0")):
        raw = os.environ.get(var, default)
        try:
            values.append(int(raw))
        except ValueError:
            raise OptionsError(f"{method}: environment variable {var}={raw!r} is not an integer",
                               where=user_source_line(),
                               fix=f"unset {var} or set it to a whole number") from None
    count, pid = values
    if count < 1 or not 0 <= pid < count:
        raise OptionsError(f"{method}: process id {pid} ({var_process_id}) is not in [0, {count}) "
                           f"({var_num_processes}={count})", where=user_source_line(),
                           fix=f"set {var_num_processes} >= 1 and 0 <= {var_process_id} < {var_num_processes}")
    return count, pid


class Options(_OptionGroup):
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

    def __init__(self) -> None:
        self._frozen = False
        self._device_iterations = 1
        self._replication_factor = 1
        self._output_mode = OutputMode.Default
        self._output_return_period = 1
        self._random_seed: int | None = None
        self._use_ipu_model = False
        self._static_shapes = False
        self._auto_outline = True
        self._training = _TrainingOptions(self)
        self._distributed = _DistributedOptions(self)

    # -- freezing -----------------------------------------------------------------
    def _is_frozen_now(self) -> bool:
        return self._frozen

    def freeze(self) -> None:
        """Forbid further changes (called when a model is compiled with these options, or a
        ``DataLoader`` built)."""
        self._frozen = True

    _freeze = freeze  # upstream's (private) spelling, which code written for PopTorch calls

    def _unfreeze(self) -> None:
        """Allow changes again (upstream's private counterpart of ``_freeze``)."""
        self._frozen = False

    @property
    def frozen(self) -> bool:
        """True once a model was compiled with these options (or a DataLoader built)."""
        return self._frozen

    def clone(self) -> "Options":
        """An unfrozen deep copy of these options (``Training`` included)."""
        copied = copy.deepcopy(self)
        copied._frozen = False
        return copied

    # -- setters ------------------------------------------------------------------
    @property
    def Training(self) -> _TrainingOptions:  # noqa: N802 - PopTorch's public name
        """Options specific to training (``opts.Training.gradientAccumulation(n)``)."""
        return self._training

    @property
    def Distributed(self) -> _DistributedOptions:  # noqa: N802 - PopTorch's public name
        """Options of a run over several host processes
        (``opts.Distributed.configureProcessId(process_id, num_processes)``)."""
        return self._distributed

    def deviceIterations(self, device_iterations: int) -> "Options":
        """Number of iterations the device runs over new batches before returning to
        the host (default: 1)."""
        self._check_not_frozen("deviceIterations")
        self._device_iterations = _positive_int(
            device_iterations, method="Options.deviceIterations", arg="device_iterations",
            example="opts.deviceIterations(4)")
        return self

    def replicationFactor(self, replication_factor: int) -> "Options":
        """Number of replicas of the model, each fed its own micro-batches (default: 1).

        This is the total over all host processes: with ``num_processes`` processes
        (torchrun, or ``opts.Distributed.configureProcessId``) each one runs and feeds
        ``replication_factor / num_processes`` of them (upstream's
        ``replicationFactor`` counts the replicas of one process instead)."""
        self._check_not_frozen("replicationFactor")
        self._replication_factor = _positive_int(
            replication_factor, method="Options.replicationFactor", arg="replication_factor",
            example="opts.replicationFactor(2)")
        return self

    def outputMode(self, output_mode: OutputMode, output_return_period: int | None = None) -> "Options":
        """Which results to return to the host: see :class:`OutputMode`.

        ``OutputMode.EveryN`` needs ``output_return_period`` (a positive int). With any
        other mode a period is ignored, as upstream does; ipuxl warns about it.
        """
        return self._set_output_mode("outputMode", "output_mode", "output_return_period",
                                     output_mode, output_return_period)

    def anchorMode(self, anchor_mode: OutputMode, anchor_return_period: int | None = None) -> "Options":
        """Upstream's older spelling of :meth:`outputMode` (takes :data:`AnchorMode`)."""
        return self._set_output_mode("anchorMode", "anchor_mode", "anchor_return_period",
                                     anchor_mode, anchor_return_period)

    def _set_output_mode(self, method: str, mode_arg: str, period_arg: str,
                         mode: object, period: object) -> "Options":
        self._check_not_frozen(method)
        if not isinstance(mode, OutputMode):
            members = ", ".join(f"OutputMode.{m.name}" for m in OutputMode)
            raise OptionsError(
                f"Options.{method}: {mode_arg} must be an OutputMode, got {mode!r} ({_type_name(mode)})",
                where=user_source_line(), fix=f"pass one of {members}")
        if mode is OutputMode.EveryN:
            if period is None:
                raise OptionsError(
                    f"Options.{method}: OutputMode.EveryN needs {period_arg}, the number of batches "
                    "between two returned results",
                    where=user_source_line(), fix=f"call opts.{method}(OutputMode.EveryN, 10)")
            resolved_period = _positive_int(period, method=f"Options.{method}", arg=period_arg,
                                            example=f"opts.{method}(OutputMode.EveryN, 10)")
        else:
            if period is not None:
                warnings.warn(
                    f"Options.{method}: {period_arg}={period!r} is ignored with OutputMode.{mode.name} "
                    "(it only applies to OutputMode.EveryN)", UserWarning, stacklevel=3)
            resolved_period = 1
        self._output_mode = mode
        self._output_return_period = resolved_period
        return self

    def defaultOutputMode(self) -> bool:
        """True while the output mode is still ``OutputMode.Default`` (as upstream)."""
        return self._output_mode is OutputMode.Default

    def randomSeed(self, random_seed: int) -> "Options":
        """Seed the device's random number generator; like upstream, also seeds torch's
        host RNG with ``torch.manual_seed(random_seed)``."""
        self._check_not_frozen("randomSeed")
        if isinstance(random_seed, bool) or not isinstance(random_seed, numbers.Integral):
            raise OptionsError(
                f"Options.randomSeed: random_seed must be an int, got {random_seed!r} "
                f"({_type_name(random_seed)})",
                where=user_source_line(), fix="pass a whole number, for example opts.randomSeed(42)")
        if not 0 <= random_seed < _MAX_SEED:
            raise OptionsError(
                f"Options.randomSeed: random_seed must be in [0, 2**64), got {random_seed}",
                where=user_source_line(), fix="pass a non-negative seed below 2**64, for example 42")
        seed = int(random_seed)
        torch.manual_seed(seed)
        self._random_seed = seed
        return self

    def useIpuModel(self, use_model: bool) -> "Options":
        """Run on the IPU Model (a simulator) instead of IPU hardware (default: False).

        ipuxl always simulates; this only changes :attr:`device_type`."""
        self._check_not_frozen("useIpuModel")
        self._use_ipu_model = _flag(use_model, method="Options.useIpuModel", arg="use_model")
        return self

    def staticShapes(self, enabled: bool = True) -> "Options":
        """ipuxl extension: when enabled, a compiled model raises an error instead of
        recompiling when the shapes of its inputs change (default: False)."""
        self._check_not_frozen("staticShapes")
        self._static_shapes = _flag(enabled, method="Options.staticShapes", arg="enabled")
        return self

    def autoOutline(self, enabled: bool = True) -> "Options":
        """ipuxl extension: outline repeated blocks automatically (default: True).

        Structurally identical regions of the captured forward, backward and update
        (e.g. N identical transformer or MLP blocks) become calls of one shared graph,
        so their code exists once on the device (``ipuxl.passes.outline``). Results
        are unchanged; False keeps every op inline."""
        self._check_not_frozen("autoOutline")
        self._auto_outline = _flag(enabled, method="Options.autoOutline", arg="enabled")
        return self

    # -- what the compiler reads --------------------------------------------------
    @property
    def auto_outline(self) -> bool:
        return self._auto_outline

    @property
    def device_iterations(self) -> int:
        return self._device_iterations

    @property
    def replication_factor(self) -> int:
        return self._replication_factor

    @property
    def gradient_accumulation(self) -> int:
        """Same as ``opts.Training.gradient_accumulation``."""
        return self._training.gradient_accumulation

    @property
    def output_mode(self) -> OutputMode:
        """The output mode as set (possibly ``OutputMode.Default``; see
        :meth:`resolved_output_mode`)."""
        return self._output_mode

    @property
    def output_return_period(self) -> int:
        """N for ``OutputMode.EveryN``; 1 for the other modes."""
        return self._output_return_period

    anchor_mode = output_mode
    anchor_return_period = output_return_period

    @property
    def random_seed(self) -> int | None:
        """The seed given to :meth:`randomSeed`, or None when none was given."""
        return self._random_seed

    @property
    def use_ipu_model(self) -> bool:
        return self._use_ipu_model

    @property
    def static_shapes(self) -> bool:
        return self._static_shapes

    @property
    def device_type(self) -> Literal["ipu_model", "ipu_hw"]:
        """``"ipu_model"`` after ``useIpuModel(True)``, else ``"ipu_hw"``."""
        return "ipu_model" if self._use_ipu_model else "ipu_hw"

    def resolved_output_mode(self, training: bool) -> OutputMode:
        """The output mode a model uses: ``Default`` becomes ``Final`` for training and
        ``All`` for inference (upstream's defaults); other modes are kept."""
        training = self._training_flag(training, "resolved_output_mode")
        if self._output_mode is OutputMode.Default:
            return OutputMode.Final if training else OutputMode.All
        return self._output_mode

    def replicas_per_process(self) -> int:
        """The replicas this process runs and feeds: ``replication_factor /
        Distributed.numProcesses``.

        Raises:
            OptionsError: the number of processes does not divide the replication factor.
        """
        processes = self._distributed.numProcesses
        if self._replication_factor % processes:
            valid = [d for d in range(1, self._replication_factor + 1) if self._replication_factor % d == 0]
            raise OptionsError(
                f"replicationFactor({self._replication_factor}) cannot be split over {processes} processes "
                f"(process {self._distributed.processId} of {processes}): each process must run the same "
                "number of replicas", where=user_source_line(),
                fix=f"use a replication factor that is a multiple of {processes}, or run {valid} processes "
                    "(torchrun --nproc_per_node)")
        return self._replication_factor // processes

    def combined_batch_factor(self, training: bool) -> int:
        """Micro-batches consumed by one run of the model: deviceIterations x
        gradientAccumulation x replicationFactor (gradient accumulation counts for
        training only).

        Raises:
            OptionsError: for inference (``training=False``) with
                ``Training.gradientAccumulation`` other than 1, which upstream's
                ``poptorch.inferenceModel`` refuses.
        """
        training = self._training_flag(training, "combined_batch_factor")
        accumulation = self._training.gradient_accumulation
        if not training and accumulation != 1:
            raise OptionsError(
                f"Options.Training.gradientAccumulation is {accumulation} but an inference model needs 1 "
                "(gradient accumulation only applies to training)",
                where=user_source_line(),
                fix="use options with opts.Training.gradientAccumulation(1) for inference (for example "
                    "`infer_opts = opts.clone(); infer_opts.Training.gradientAccumulation(1)`); use "
                    "opts.deviceIterations(n) to process more batches per run")
        factor = self._device_iterations * self._replication_factor
        return factor * accumulation if training else factor

    @staticmethod
    def _training_flag(training: object, method: str) -> bool:
        if not isinstance(training, bool):
            raise InvalidArgumentError(
                f"Options.{method}: training must be True or False, got {training!r} ({_type_name(training)})",
                where=user_source_line(), fix=f"call opts.{method}(training=True) or (training=False)")
        return training

    def to_dict(self) -> dict[str, Any]:
        """The option values as a plain dict (for logs and compilation cache keys)."""
        return {
            "device_iterations": self._device_iterations,
            "replication_factor": self._replication_factor,
            "gradient_accumulation": self._training.gradient_accumulation,
            "output_mode": self._output_mode,
            "output_return_period": self._output_return_period,
            "random_seed": self._random_seed,
            "use_ipu_model": self._use_ipu_model,
            "static_shapes": self._static_shapes,
        }

    def __repr__(self) -> str:
        fields = {**self.to_dict(), "frozen": self._frozen}
        body = ", ".join(f"{k}=OutputMode.{v.name}" if isinstance(v, OutputMode) else f"{k}={v!r}"
                         for k, v in fields.items())
        return f"{type(self).__name__}({body})"
