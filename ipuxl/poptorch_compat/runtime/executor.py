"""``trainingModel`` / ``inferenceModel``: PopTorch's wrappers on ipuxl's IR and device.

A ``PoplarExecutor`` (upstream's class name) is a ``compiled_model.CompiledModel``
(compiled on the first call, run on a ``Session``, weights kept in step with the host
module) with PopTorch's executor API: ``getPerfCounters`` and the latencies (``perf``:
host timestamps of the whole call), ``getTensorNames`` (the IR's names),
``getAnchoredTensor`` (``compile.anchors``), ``rng_state`` (the device seed),
``save``/``compileAndExport``/``loadExecutable`` and ``load`` (``executable_file``: an
ipuxl file that rebuilds the program), and ``cycleCount`` (refused: no cycle counter).
The compile hooks are ``compile.hooks``.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ipuxl.errors import AnchorError, ExecutorError, InvalidValueError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.compile.ipu_state import ipu_param, state_name
from ipuxl.poptorch_compat.compile.popart_ir import popart_ir
from ipuxl.poptorch_compat.compile.anchors import anchorable_names, parameter_paths
from ipuxl.poptorch_compat.compile.program import per_replica_seeds
from ipuxl.poptorch_compat.enums import ConnectionType
from ipuxl.poptorch_compat.options import Options
from ipuxl.poptorch_compat.runtime.compiled_model import CompiledModel, refuse_second_training_wrapper
from ipuxl.poptorch_compat.runtime.executable_file import example_inputs, read_executable, write_executable
from ipuxl.poptorch_compat.runtime.perf import latency, perf_counters

__all__ = ["PoplarExecutor", "trainingModel", "inferenceModel", "load", "POPTORCH_VERSION"]

#: ``poptorch.__version__``: the PopTorch release whose API ipuxl follows, with ipuxl as local label
POPTORCH_VERSION = "3.3.0+ipuxl"


def trainingModel(model: torch.nn.Module, options: Options | None = None,  # noqa: N802 - PopTorch's name
                  optimizer: torch.optim.Optimizer | None = None,
                  loss: Callable[[Any, Any], torch.Tensor] | None = None) -> "PoplarExecutor":
    """Wrap ``model`` for training on the device (PopTorch's ``trainingModel``).

    Args:
        model: an ``nn.Module`` whose forward returns the loss, alone or among its
            outputs (see ``capture.mode`` for how the loss is found).
        options: ``ipuxl.Options`` (device iterations, gradient accumulation,
            output mode, random seed); frozen once the model is compiled.
        optimizer: a ``torch.optim`` SGD/Adam/AdamW/RMSprop or an ``ipuxl.optim``
            optimiser over the model's parameters (default: SGD, lr 0.01, as upstream).
        loss: optional loss function: the model then returns only its output,
            the last input of each call is the target, and the wrapper returns
            ``(output, loss)``.
    """
    if isinstance(model, PoplarExecutor):
        model = model.model
    refuse_second_training_wrapper(model)
    if optimizer is None and any(p.requires_grad for p in model.parameters()):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return PoplarExecutor(model, options, training=True, optimizer=optimizer, loss=loss)


def inferenceModel(model: torch.nn.Module, options: Options | None = None) -> "PoplarExecutor":  # noqa: N802
    """Wrap ``model`` for inference on the device: eval mode (dropout off, BatchNorm
    running statistics), outputs of every iteration by default (``OutputMode.All``).
    ``model`` may be a training model: its module is wrapped (the two share the weights)."""
    if isinstance(model, PoplarExecutor):
        model = model.model
    return PoplarExecutor(model, options, training=False)


class NotCompiledError(ExecutorError, AssertionError):
    """A method that needs the compiled program was called before compiling, where PopTorch
    asserts (``getTensorNames``): a ``poptorch.Error`` and an ``AssertionError``."""


class PoplarExecutor(CompiledModel):
    """A module compiled for the device; call it like the module (see ``trainingModel``)."""

    # -- upstream attributes read by clients (PyTorch Lightning's IPUStrategy...) ----------------
    @property
    def _options(self) -> Options:
        """The model's ``poptorch.Options`` (upstream's attribute; ``options`` here too)."""
        return self.options

    @property
    def _executable(self) -> Any:
        """The compiled program, None before the first compile and after ``destroy()``
        (upstream's attribute: its C++ executable; clients test it against None)."""
        return None if self._destroyed else self._sync.compiled

    def __reduce__(self) -> tuple[Any, tuple]:
        """Pickled (``torch.save(model)``) as a wrapper of its module (with the device's current
        weights), options, optimiser and loss, not compiled: unpickling wraps the unpickled
        module again, and its first call compiles it."""
        if self._sync.compiled is not None:
            self._sync.pull_state_if_newer()
        return _rewrap, (self.training, self._user_model, self.options, self.optimizer, self._loss)

    # -- perf counters and latencies ---------------------------------------------------------
    def getPerfCounters(self) -> dict[str, list[list[float]]]:  # noqa: N802
        """Timestamps of the last call: ``{"input", "input_complete", "output",
        "output_complete"}``, each a list per input (output) tensor of one value per
        device iteration, in seconds. ipuxl times the whole call, not each iteration:
        every iteration holds the call's timestamps (see ``perf``)."""
        return perf_counters(self._times)

    def getHostIpuLatency(self) -> tuple[float, float, float]:  # noqa: N802
        """``(min, max, average)`` seconds from the first input requested to the last transferred."""
        return latency(self.getPerfCounters(), "input", min, "input_complete", max)

    def getComputeLatency(self) -> tuple[float, float, float]:  # noqa: N802
        """``(min, max, average)`` seconds from the last input transferred to the last output available."""
        return latency(self.getPerfCounters(), "input_complete", max, "output", max)

    def getIpuHostLatency(self) -> tuple[float, float, float]:  # noqa: N802
        """``(min, max, average)`` seconds from the first output available to the last copied to the host."""
        return latency(self.getPerfCounters(), "output", min, "output_complete", max)

    def getLatency(self) -> tuple[float, float, float]:  # noqa: N802
        """``(min, max, average)`` round-trip seconds: first input requested to last output copied."""
        return latency(self.getPerfCounters(), "input", min, "output_complete", max)

    def cycleCount(self) -> int:  # noqa: N802
        """PopTorch's IPU cycle count: not available, the simulated device has no cycle counter.

        Raises:
            ExecutorError: always; without ``Options.logCycleCount(True)`` with upstream's
                message ("Cycle count logging is disabled...").
        """
        if not self.options.toDict().get("instrumentWithHardwareCycleCounter", False):
            raise ExecutorError("Cycle count logging is disabled. Please set option logCycleCount to True to enable.",
                                where=user_source_line(), fix="call opts.logCycleCount(True) (as upstream requires)")
        raise ExecutorError("cycleCount(): the simulated IPU has no hardware cycle counter", where=user_source_line(),
                            fix="time calls with getPerfCounters() or getLatency() instead")

    # -- tensor names and anchored tensors -------------------------------------------------
    def _debugGetPopartIR(self) -> str:  # noqa: N802 - PopTorch's (private) name
        """The compiled program as upstream's PopART IR dump: JSON ``{"maingraph": [op...]}``
        with PopART's op types for the ops ipuxl runs (``compile.popart_ir``)."""
        compiled = self._compiled_for("_debugGetPopartIR")
        return popart_ir(compiled.program.ir, self._trainable_plans() if self.training else [],
                         training=self.training)

    def getTensorNames(self) -> list[str]:  # noqa: N802
        """The names of the compiled program's tensors: first the PopART names
        ``Options.anchorTensor`` accepts (``anchors``), then (training) the optimiser's
        state and scalars by PopART's names (``compile.ipu_state``: ``Accl1___...``,
        ``learningRate___specific___...``, ``scaledLearningRate0___...``), then ipuxl's:
        its host streams and every tensor of every graph (variables, constants, op
        results) in program order."""
        if self._sync.compiled is None:  # upstream asserts it
            raise NotCompiledError("Model must be compiled before calling getTensorNames", where=user_source_line(),
                                   fix="call the model (or model.compile(...)) first")
        compiled = self._sync.compiled
        program = compiled.program
        paths = parameter_paths(list(self._names.values()), wrapped=self._model is not self._user_model)
        names = anchorable_names(paths, program.trained, self.training)
        if self.training:
            plans = self._trainable_plans()
            states = [state_name(key, plans) for key in program.states]
            names += [name for name in states if name is not None] + list(ipu_param(plans))
        names += [stream.name for stream in program.ir.streams] + [t.name for g in program.ir.graphs for t in g.tensors]
        return list(dict.fromkeys(names))

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:  # noqa: N802
        """The value of the tensor anchored as ``short_name`` (``Options.anchorTensor``) in
        the last call, reduced per its output mode (see ``anchors``).

        Raises:
            AnchorError: ``short_name`` is not anchored, or the model has not run yet.
        """
        if short_name in self._anchored:
            return self._anchored[short_name]
        anchored = list(self.options.anchored_tensors)
        if short_name in anchored:
            raise AnchorError(f"getAnchoredTensor({short_name!r}): no tensor with name {short_name!r} found: the "
                              f"{self._kind} model has not run yet", where=user_source_line(),
                              fix="call the model first: anchored tensors are returned by each call")
        raise AnchorError(f"getAnchoredTensor({short_name!r}): no tensor with name {short_name!r} found; anchored: "
                          f"{', '.join(map(repr, anchored)) or 'none'}", where=user_source_line(),
                          fix=f"anchor it before the first call: opts.anchorTensor({short_name!r}, "
                              "'Gradient___<param>'), or use one of the anchored names")

    # -- random state ---------------------------------------------------------------------
    @property
    def rng_state(self) -> list[int]:
        """The device's random seed state: the seed words of the generator that dropout and
        random ops draw from (with R replicas, each replica's two words). Setting it back
        reproduces the same random draws."""
        compiled = self._compiled_for("rng_state")
        seed = self._sync.device_seed() if self._sync.attached else None
        value = self._seed if seed is None or compiled.program.seed is None else seed
        return [int(v) for v in np.asarray(value).reshape(-1)]

    @rng_state.setter
    def rng_state(self, state: Sequence[int]) -> None:
        self._compiled_for("set rng_state")
        replicas = self.options.total_replicas()
        words = np.asarray(list(state), np.int64)
        if words.size == 2:
            words = words if replicas == 1 else per_replica_seeds(words, replicas)
        elif words.size == 2 * replicas:
            words = words.reshape(replicas, 2)
        else:
            raise InvalidValueError(f"rng_state must hold 2 seed words (or 2 per replica: {2 * replicas}), got "
                                    f"{words.size}", where=user_source_line(),
                                    fix="pass a value read from model.rng_state")
        self._seed = words
        self._seed_dirty = True
        if self._sync.attached:
            self._write_seed()

    # -- executable files -----------------------------------------------------------------
    def save(self, filename: str | os.PathLike[str], export_model: bool = True, save_rng_state: bool = True) -> None:
        """Save the compiled model to an ipuxl executable file (``executable_file``).

        Args:
            export_model: also save the module (with its current weights) and the
                optimiser (with its state), so that ``load(filename)`` rebuilds it all;
                else wrap the module yourself and call ``loadExecutable(filename)``.
            save_rng_state: also save ``rng_state``.
        """
        self._compiled_for("save")
        assert self._example is not None, "a compiled model has example inputs"
        contents: dict[str, Any] = {"poptorch_version": POPTORCH_VERSION, "training": self.training,
                                    "inputs": self._example, "options": self.options}
        if export_model:
            self._sync.pull_state_if_newer()
            contents.update(model=self._user_model, optimizer=self.optimizer,
                            loss=self._loss)
        if save_rng_state:
            contents["rng_state"] = self.rng_state
        write_executable(filename, contents)

    def compileAndExport(self, filename: str | os.PathLike[str], *args: Any, export_model: bool = True,  # noqa: N802
                         **kwargs: Any) -> None:
        """Compile for these inputs (as ``compile``) and ``save`` the result to ``filename``."""
        self.compile(*args, **kwargs)
        self.save(filename, export_model)

    def loadExecutable(self, filename: str | os.PathLike[str]) -> None:  # noqa: N802
        """Compile for the inputs saved in an ipuxl executable file and restore its
        ``rng_state`` (the weights and optimiser stay this model's own)."""
        self._revive()
        data = read_executable(filename)
        if data["training"] != self.training:
            saved = "training" if data["training"] else "inference"
            raise ExecutorError(f"{os.fspath(filename)} holds a {saved} executable; this is a {self._kind} model",
                                where=user_source_line(), fix=f"load it into a {saved} model")
        args, kwargs = example_inputs(data["inputs"])
        self._compile(args, kwargs, again=True)
        if "rng_state" in data:
            self.rng_state = data["rng_state"]


def _rewrap(training: bool, model: torch.nn.Module, options: Options, optimizer: torch.optim.Optimizer | None,
            loss: Callable[[Any, Any], torch.Tensor] | None) -> PoplarExecutor:
    """Unpickle a ``PoplarExecutor`` (see ``PoplarExecutor.__reduce__``)."""
    if training:
        return trainingModel(model, options, optimizer=optimizer, loss=loss)
    return inferenceModel(model, options)


def load(filename: str | os.PathLike[str],
         edit_opts_fn: Callable[[Options], None] | None = None) -> PoplarExecutor:
    """Rebuild a model saved by ``compileAndExport``/``save`` with ``export_model=True``
    (PopTorch's ``poptorch.load``): the module, its optimiser and options, compiled for
    the saved inputs, with the saved ``rng_state``.

    Args:
        edit_opts_fn: called with (a copy of) the saved options before the model is
            wrapped, e.g. to change ``deviceIterations``.

    Raises:
        ExecutorError: the file is not an ipuxl executable, or holds no model.
    """
    data = read_executable(filename)
    if data.get("model") is None:
        raise ExecutorError(f"{os.fspath(filename)} holds no model: it was saved with export_model=False",
                            where=user_source_line(),
                            fix="wrap the module with trainingModel/inferenceModel and call "
                                "loadExecutable(filename) on it")
    options = data["options"].clone()
    if options.connection_type == ConnectionType.Never:  # as upstream: a file exported offline runs
        options.connectionType(ConnectionType.Always)
    if edit_opts_fn is not None:
        edit_opts_fn(options)
    if data["training"]:
        executor = trainingModel(data["model"], options, optimizer=data["optimizer"], loss=data.get("loss"))
    else:
        executor = inferenceModel(data["model"], options)
    executor.loadExecutable(filename)
    return executor
