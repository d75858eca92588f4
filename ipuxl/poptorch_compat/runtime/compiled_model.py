"""A wrapped module compiled on demand and run on a device ``Session`` (the core of ``PoplarExecutor``).

A ``CompiledModel`` owns the user's module, compiles it on the first call
(``compile.compile_model``: capture, IR, autodiff, step program, outlining) and runs it
on a ``Session``: one call is one ``Session.run`` of ``deviceIterations`` steps over the
combined batch. A later call with the compiled inputs runs the program; another one raises
PopTorch's error under PopTorch's contract, or compiles again with ipuxl's own API
(``call_inputs``; ``compile.log`` says why). After ``destroy()`` a call compiles again.
``runtime.executor.PoplarExecutor`` adds PopTorch's introspection and file API to it.

With ``replicationFactor(R)`` the program runs R data-parallel replicas (see
``compile.program``). The combined batch is split as PopART lays out host data, and
outputs come back in the same order (``compile.batching``). Under torchrun
(``WORLD_SIZE`` = P > 1) each process feeds and gets back only its R / P replicas, as
each PopTorch process does with PopRun; the weights read back are replica 0's.

Weights (``weights``, ``weight_sync``, README "Weights and checkpoints"): on the CPU
devices the host module's parameters and buffers are the device's storage, so the
module always shows the trained weights; elsewhere the device holds a copy that
reads of the module pull and host writes push, per tensor. The torch optimiser's
``state_dict()``/``load_state_dict()`` read and write the device's optimiser state.
A run that fails in step k keeps steps 1..k-1 (host and device agree; the error
says so). A refused call (a shape that cannot be traced, a changed input dtype)
leaves the compiled program and the weights as they were.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Callable

import numpy as np
import torch

from ipuxl.capture.trace import parameter_hooks
from ipuxl.device.profile import Profile
from ipuxl.device.session import Session, device_for
from ipuxl.dtypes import to_numpy_dtype
from ipuxl.errors import (
    DetachedError, DeviceError, ExecutorError, InvalidArgumentError, StreamInputError, TraceError,
)
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.compile.anchors import gather_anchors, plan_anchors
from ipuxl.poptorch_compat.compile.batching import (
    MicroBatch, describe, example_call, gather_outputs, replicas_here, split_batch, update_inputs,
)
from ipuxl.poptorch_compat.compile.compile_model import compile_model
from ipuxl.poptorch_compat.compile.hooks import run_post_compile_hooks, run_pre_compile_hooks
from ipuxl.poptorch_compat.compile.log import log_recompile, program_stages, recompile_reason
from ipuxl.poptorch_compat.compile.optimizer_log import OptimizerLog
from ipuxl.poptorch_compat.optim_base import Optimizer as PoptorchOptimizer
from ipuxl.poptorch_compat.runtime.ipu_optimizer_state import IpuOptimizerState
from ipuxl.poptorch_compat.compile.memory_format import choose as choose_memory_format, to_format
from ipuxl.poptorch_compat.compile.program import StartValues, hyper_values, optimizer_structure
from ipuxl.poptorch_compat.compile.report import annotate_report
from ipuxl.poptorch_compat.compile.translate import AttributeChecks, ParamPlan, check_replacement, translate
from ipuxl.poptorch_compat.model_options import model_options, resolve_mean_reduction_strategy
from ipuxl.poptorch_compat.options import Options
from ipuxl.poptorch_compat.runtime.call_inputs import (
    CompiledCall, bind_call, keyword_form, poptorch_contract, refuse_zero_sized, warn_inputs_requiring_grad,
)
from ipuxl.poptorch_compat.runtime.connection import attaches, refuse_offline
from ipuxl.poptorch_compat.runtime.live_models import LIVE, WithLoss, initial_seed, refuse_second_training_wrapper
from ipuxl.poptorch_compat.runtime.executable_file import input_specs
from ipuxl.poptorch_compat.runtime.perf import CallTimes
from ipuxl.poptorch_compat.runtime.weight_sync import Compiled, WeightSync
from ipuxl.poptorch_compat.runtime.weights import HostSlots, host_view, named_tensors, to_numpy
from ipuxl.progress import graph_sizes, pipeline

__all__ = ["CompiledModel", "refuse_second_training_wrapper", "NO_EXECUTABLE"]

#: PopTorch's message when a method needs a compiled executable
NO_EXECUTABLE = "Model has not been compiled or has been destroyed."

_LOG = logging.getLogger("poptorch::python")


class CompiledModel:
    """A module compiled for the device on demand; call it like the module (see ``runtime.executor``)."""

    _hooks: tuple = ()  # the parameters' gradient hooks the program was compiled with (``parameter_hooks``)

    def __init__(self, model: torch.nn.Module, options: Options | None, *, training: bool,
                 optimizer: torch.optim.Optimizer | None = None, loss: Callable | None = None):
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(f"expected an nn.Module, got {type(model).__name__}",
                                       where=user_source_line(), fix="wrap a torch.nn.Module")
        self._user_model = model
        self._model = model if loss is None else WithLoss(model, loss)  # what the program calls
        self._loss = loss  # the loss function of trainingModel(..., loss=...), or None
        # as upstream's executor: the user's options frozen, the model's own resolved copy
        self.options = model_options(options, training, optimizer)
        self.training = training
        self._names = {p: n for n, p in torch.nn.Module.named_parameters(self._model)}
        plans = translate(optimizer, self._names) if training and optimizer is not None else []
        self._attribute_checks = AttributeChecks(self.options.relax_optimizer_attributes_checks, optimizer)
        self._key: tuple | None = None  # the compile key: the micro-batch call (``batching.split_batch``)
        self._call: CompiledCall | None = None  # the call compiled for (``call_inputs``)
        self._fixed_inputs = poptorch_contract()  # PopTorch's contract: a compiled model's inputs are fixed
        self._format: tuple[tuple, bool] | None = None  # (key, channels-last?): ``memory_format.choose``
        self._channels_last = False  # the compiled program runs channels-last
        self._destroyed = False
        self.compile_count = 0
        self._seed = initial_seed(self.options)
        self._seed_dirty = False  # rng_state set while detached: written on attach
        self._hypers_pending = False  # setOptimizer's values set while detached: written on attach
        self._times: CallTimes | None = None  # the last call's timestamps (getPerfCounters)
        self._example: Any = None  # the compiled call's input specs (save)
        self._anchored: dict[str, torch.Tensor] = {}  # the last call's anchored tensors (getAnchoredTensor)
        self._sync = WeightSync(self._model, training=training, optimizer=optimizer, plans=plans)
        # what upstream's backend logs of the optimiser (names: the user module's, as upstream's)
        self._optimizer_log = OptimizerLog({id(p): n for n, p in torch.nn.Module.named_parameters(model)})
        self._ipu_state = IpuOptimizerState(self)  # upstream's ipu_state / ipu_param of a PopTorch optimiser
        self._ipu_state.adopt(optimizer)
        if isinstance(optimizer, PoptorchOptimizer) and optimizer.has_state():  # loaded before it was wrapped
            self._ipu_state.loaded(optimizer.state_dict())
        LIVE.add(self)
        # a wrapper dropped without destroy() leaves its trained weights in the host module: where
        # the device keeps its own copy (a GPU, several replicas), they are pulled back when it goes
        weakref.finalize(self, self._sync.pull_weights_if_newer).atexit = False

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimiser (training; ``setOptimizer`` replaces it)."""
        return self._sync.optimizer

    # -- calling ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._revive()
        refuse_offline(self.options, self._kind, "run")
        started = time.perf_counter()
        args, kwargs = self._call_inputs(args, kwargs)
        batch = split_batch(self.options, self.training, args, kwargs)
        self._ensure_program(batch.micro, (args, kwargs))
        if self._channels_last:  # staged channels-last, as traced (``memory_format``); writes go to the caller's
            batch = batch._replace(stacked=split_batch(self.options, self.training,
                                                       *to_format(args, kwargs, True)).stacked)
        if not self._sync.attached:  # as PopTorch: a call attaches a detached model (host weights go to it)
            self.attachToDevice()
        self._sync_before_run()
        compiled = self._require_compiled()  # pushing a loaded optimiser's state may have recompiled
        program = compiled.program
        staged = time.perf_counter()
        try:
            results = compiled.session.run_on_device(dict(zip(program.inputs, batch.stacked)))
        except DeviceError as exc:
            if exc.steps_applied is not None:  # steps ran: the device keeps them (see Session.run)
                self._sync.after_run(exc.steps_applied, partial=True)
            raise
        ran = time.perf_counter()
        self._sync.after_run(self.options.device_iterations)
        self._ipu_state.ran()
        update_inputs(self.options, program, results, batch.tensors)
        outputs = gather_outputs(self.options, self.training, program, results)
        if program.anchors is not None:
            self._anchored = gather_anchors(program.anchors, self.options, results)
        self._times = CallTimes(started, staged, ran, time.perf_counter(), len(program.inputs),
                                len(program.outputs), self.options.device_iterations)
        return outputs

    def profile(self, *args: Any, runs: int = 3, warmup: int = 1, top: int = 20,
                trace_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> Profile:
        """ipuxl only: call the model on ``args`` ``warmup`` times, then ``runs`` times
        under ``torch.profiler``, every op of the program labelled by its graph, op and
        the user's source line (``Session.profile``, ``ipuxl.device.profile``).

        Each call is a real call (``deviceIterations`` steps): a training model's weights
        and optimiser state advance as if it had been called ``warmup + runs`` times.
        The model is compiled for ``args`` first when needed, as calling it does.

        Args:
            args, kwargs: the inputs of each call, as for calling the model.
            runs: calls to profile; warmup: calls before them, not profiled.
            top: rows ``print(profile)`` shows.
            trace_path: where to write the Chrome/Perfetto trace JSON (None: not written).

        Returns:
            The ``Profile``: ``print`` it for the most expensive ops and their share of the calls.

        Raises:
            DetachedError: the model is destroyed (a call compiles it again; a detached one attaches).
            InvalidValueError: ``runs`` or ``top`` < 1, or ``warmup`` < 0.
            UnsupportedError: more than one replica in this process (see ``Session.profile``).

        Example:
            >>> print(model.profile(x, y, runs=3, trace_path="trace.json"))
        """
        self._require_usable("profile the model")
        refuse_offline(self.options, self._kind, "run")
        args, kwargs = self._call_inputs(args, kwargs)
        self._ensure_program(split_batch(self.options, self.training, args, kwargs).micro, (args, kwargs))
        if not self._sync.attached:  # as calling it: a detached model attaches
            self.attachToDevice()
        self._sync_before_run()  # a pending recompile happens now, not during the profiled calls
        session = self._require_compiled().session
        return session.profile(runs=runs, warmup=warmup, top=top, trace_path=trace_path,
                               run_fn=lambda: self(*args, **kwargs))

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Trace and compile for these inputs without running (PopTorch's ``compile``: ignored,
        with a warning, once compiled; with ipuxl's own API, other inputs compile for them)."""
        self._compile(args, kwargs, again=False)

    def _compile(self, args: tuple, kwargs: dict[str, Any], *, again: bool) -> None:
        """``compile``; with ``again``, a compiled model compiles for other inputs (``loadExecutable``)."""
        self._revive()
        call = bind_call(self._model, args, kwargs)
        args, kwargs = call.args, call.kwargs
        compiled = self._sync.compiled is not None and self._call is not None and not again
        if compiled and self._fixed_inputs:
            _LOG.warning("Call to compile() ignored: the executable is already compiled")
            return
        if compiled and self._call is not None:
            args, kwargs = self._call.match(call, fixed=False)
        args, kwargs = keyword_form(self._model, args, kwargs)
        key = split_batch(self.options, self.training, args, kwargs).micro
        if self._sync.compiled is not None and key == self._key:
            _LOG.warning("Call to compile() ignored: the executable is already compiled")
            return
        self._ensure_program(key, (args, kwargs))

    def _call_inputs(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The call to run: bound to ``forward``, laid out as the compiled call when it is the
        same call; under PopTorch's contract another call raises (``call_inputs``)."""
        call = bind_call(self._model, args, kwargs)
        if self._call is None or self._sync.compiled is None:
            if self._fixed_inputs:
                refuse_zero_sized(self._model, (call.args, call.kwargs))
            return keyword_form(self._model, call.args, call.kwargs)
        return keyword_form(self._model, *self._call.match(call, fixed=self._fixed_inputs))

    @property
    def _kind(self) -> str:
        return "training" if self.training else "inference"

    # -- compiling ------------------------------------------------------------------------
    def _ensure_program(self, key: tuple, call: tuple[tuple, dict[str, Any]]) -> None:
        """Have a program compiled for the call ``key`` (``batching.SplitBatch.micro``) of
        the inputs ``call``: compile when the key changed (refused under ``Options.staticShapes``)."""
        compiled = self._sync.compiled
        hooks = parameter_hooks((n, p) for p, n in self._names.items()) if self.training else ()  # changed: compile
        if compiled is not None and key == self._key and hooks == self._hooks:
            return
        if compiled is not None and key == self._key:
            log_recompile(self._kind, "the parameters' gradient hooks changed")
        elif compiled is not None:
            self._check_same_dtypes(compiled, key)
            if self.options.static_shapes:
                raise TraceError(
                    f"the {self._kind} model was compiled for inputs {describe(self._key)}, got {describe(key)}",
                    where=user_source_line(),
                    fix="keep input shapes and dtypes fixed (e.g. drop_last=True in the DataLoader), or "
                        "leave Options.staticShapes off to recompile on a change")
            log_recompile(self._kind, recompile_reason(self._key, key, compiled.program.traced.input_names))
        warn_inputs_requiring_grad(call)
        self._rebuild(key)
        self._example, self._hooks = input_specs(call), hooks
        self._call = CompiledCall(bind_call(self._model, *call))

    def _check_same_dtypes(self, compiled: Compiled, key: tuple) -> None:
        """Refuse an input whose dtype differs from the compiled program's (PopTorch does too)."""
        assert self._key is not None
        old_leaves, new_leaves = self._key[0], key[0]
        if key[1] != self._key[1] or len(old_leaves) != len(new_leaves):
            return
        names = iter(compiled.program.traced.input_names)
        for old, new in zip(old_leaves, new_leaves):
            if not isinstance(old, MicroBatch):
                continue
            name = next(names)
            if isinstance(new, MicroBatch) and new.dtype != old.dtype:
                want = str(old.dtype).replace("torch.", "")
                raise StreamInputError(
                    f"{self._kind} model input '{name}' has dtype {str(new.dtype).replace('torch.', '')}; the model "
                    f"was compiled for {want} (its first call)", where=user_source_line(),
                    fix=f"convert the input, e.g. {name}.to(torch.{want}), or destroy() this model and wrap the "
                        "module again to compile it for the new dtype")

    def _rebuild(self, key: tuple | None = None, *, states_from_optimizer: bool = False) -> None:
        """(Re)compile for the call ``key`` (default: the current one), carrying weights,
        optimiser state and seed over from a previous program.

        The new program and session are built before the old ones are released, so a
        refused trace (or any failure while building) leaves the model as it was."""
        key = self._key if key is None else key
        assert key is not None, "a first compile names its call"
        sync = self._sync
        if sync.optimizer_dirty:  # a loaded optimizer state dict: its hyperparameters and state
            sync.plans = self._ipu_state.plans(self._translate())
            states_from_optimizer = True
        start = self._start_values(states_from_optimizer)
        args, kwargs = example_call(key)
        if self._format is None or self._format[0] != key:
            # one replica here: its stream data keeps the format (several are regrouped, see batching);
            # CPU only: the rule was measured on the host's convolution kernels
            self._format = (key, replicas_here(self.options) == 1
                            and device_for(self.options.device_type).type == "cpu"
                            and choose_memory_format(self._model, args, kwargs, self.training))
        channels_last = self._format[1]
        args, kwargs = to_format(args, kwargs, channels_last)
        run_pre_compile_hooks()
        try:
            stages = program_stages(self.training, self.options.auto_outline)  # ``ipuxl.progress``: bar, INFO log
            with pipeline(f"the {self._kind} model for inputs {describe(key)}", stages,
                          show=self.options.show_compilation_progress_bar, sizes=lambda: graph_sizes(program.ir.graphs)):
                program = compile_model(self._model, args, kwargs, training=self.training, options=self.options,
                                        start=start, plans=self._trainable_plans(), fixed_buffers=self._fixed_inputs)
                slots = HostSlots(self._model, {**program.params, **program.buffers},
                                  device=device_for(self.options.device_type), bind=replicas_here(self.options) == 1)
                session = Session(program.ir, self.options.device_type, storage=slots.storage())  # stage "compile"
            session.__enter__()
        finally:
            run_post_compile_hooks()
        self.options.freeze()
        sync.use(Compiled(program, session, slots))
        if not attaches(self.options):  # ConnectionType.Never: compiled, never attached
            sync.close_session()
        self._key, self._seed, self._channels_last = key, start.seed, channels_last
        self.compile_count += 1
        if sync.optimizer is not None:
            self._optimizer_log.log(sync.optimizer)
            if sync.attached:
                self._ipu_state.compiled()

    def _start_values(self, states_from_optimizer: bool) -> StartValues:
        """What a new program starts from: the host weights (newer device weights pulled
        first, also from models sharing them), the optimiser state and the seed."""
        sync = self._sync
        if sync.compiled is not None:
            sync.pull_weights_if_newer()
            states = sync.optimizer_states() if states_from_optimizer else sync.device_states()
            seed = sync.device_seed()
        else:
            states = sync.optimizer_states() if self.training else {}
            seed = None
        sync.pull_shared()
        weights = {n: host_view(t) for n, t in named_tensors(self._model)}
        anchors = plan_anchors(self.options, self.training, list(self._names.values()),
                               wrapped=self._model is not self._user_model)
        return StartValues(weights, states, self._seed if seed is None else seed, anchors)

    def _trainable_plans(self) -> list[ParamPlan]:
        """Plans of the parameters that take gradients (torch.optim skips the others)."""
        params = dict(torch.nn.Module.named_parameters(self._model))
        return [plan for plan in self._sync.plans if params[plan.name].requires_grad]

    def _translate(self) -> list[ParamPlan]:
        optimizer = self._sync.optimizer
        assert optimizer is not None, "only a training model with an optimiser has plans"
        return translate(optimizer, self._names)

    def _require_compiled(self) -> Compiled:
        compiled = self._sync.compiled
        assert compiled is not None, "compiled by _ensure_program"
        return compiled

    # -- weights ------------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's ``state_dict()``, with the device's current weights."""
        return self._user_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load weights into the wrapped module and the device (PopTorch's ``load_state_dict``)."""
        result = self._user_model.load_state_dict(state_dict, strict=strict, assign=assign)
        if self._sync.compiled is not None and self._sync.attached:
            self._sync.push_host_writes()
        return result

    def copyWeightsToHost(self) -> None:  # noqa: N802 - PopTorch's name
        """Copy the device's weights and buffers (and optimiser state) into the host module."""
        self._require_usable("copy weights to the host")
        if self._sync.compiled is None:
            return
        self._require_attached("copyWeightsToHost")
        self._sync.pull(keep_host_writes=False)

    def copyWeightsToDevice(self) -> None:  # noqa: N802
        """Copy the host module's weights and buffers to the device."""
        self._require_usable("copy weights to the device")
        if self._sync.compiled is None:
            return
        self._require_attached("copyWeightsToDevice")
        self._sync.push()

    def _sync_before_run(self) -> None:
        self._sync.pull_shared()
        if self._sync.optimizer_dirty:
            self._push_optimizer()
        self._sync.push_host_writes()

    # -- optimiser ------------------------------------------------------------------------
    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: N802
        """Use ``optimizer``'s hyperparameters from the next call (PopTorch's ``setOptimizer``).

        As PopTorch: the optimiser's variable attributes (``translate.variable_hypers``:
        ``variable_attrs`` of an ``ipuxl.optim`` optimiser; for ``torch.optim`` the
        learning rate and any attribute away from its default) are variables of the
        program: new values are written to them, without recompiling. Changing a
        constant attribute, an attribute's constness or ``max_grad_norm`` once
        compiled raises ``ExecutorError`` (PopART's message). Unlike PopTorch, another
        optimiser type, flag (``amsgrad``...) or state dtype recompiles, keeping the
        weights and the optimiser state that still applies.

        Raises:
            ExecutorError: a constant attribute changed (see above).
        """
        self._require_usable("set the optimizer")
        if not self.training:
            raise InvalidArgumentError("setOptimizer on an inference model", where=user_source_line(),
                                       fix="only training models have an optimizer")
        resolve_mean_reduction_strategy(self.options, optimizer, compiled=self._sync.compiled is not None)
        plans = translate(optimizer, self._names)
        if self._sync.compiled is not None:
            check_replacement(self._sync.plans, plans)
        self._attribute_checks.check(optimizer)
        self._ipu_state.adopt(optimizer)
        self._sync.set_optimizer(optimizer)
        self._apply_plans(plans)
        if self._sync.compiled is not None:
            self._optimizer_log.log(optimizer)

    def _apply_plans(self, plans: list[ParamPlan], *, states_from_optimizer: bool = False) -> None:
        """Use ``plans`` from the next run: new values of variable hyperparameters are
        written to their variables; any other change recompiles."""
        old, self._sync.plans = self._sync.plans, plans
        compiled = self._sync.compiled
        if compiled is None:
            return
        if optimizer_structure(plans) != optimizer_structure(old):
            log_recompile(self._kind, "the optimizer changed (type, flags or state dtypes): its variables cannot "
                                      "hold the new one")
            self._rebuild(states_from_optimizer=states_from_optimizer)
            return
        if not self._sync.attached:  # as PopTorch: the new values reach the device when it attaches again
            self._hypers_pending = True
            return
        program = compiled.program
        updates = hyper_values(program, plans)
        if states_from_optimizer:
            states = self._sync.optimizer_states()
            for (name, state), var in program.states.items():
                value = states.get((name, state))
                dtype = to_numpy_dtype(var.dtype)
                updates[var] = (np.zeros(var.shape, dtype) if value is None
                                else np.asarray(value, dtype).reshape(var.shape))
        compiled.session.write_variables_data(updates)

    def _push_optimizer(self) -> None:
        if isinstance(self._sync.optimizer, PoptorchOptimizer):  # upstream writes weights and state together
            if self._sync.weights_newer:
                _LOG.debug("Implicit copyWeightsToHost()")
                self._sync.pull_weights_if_newer()
            self._ipu_state.pushed()
        self._sync.optimizer_dirty = False
        self._apply_plans(self._ipu_state.plans(self._translate()), states_from_optimizer=True)

    # -- device ---------------------------------------------------------------------------
    def detachFromDevice(self) -> None:  # noqa: N802
        """Copy weights to the host and release the device (the next call, or ``attachToDevice``,
        attaches it again with the host's weights, as in PopTorch)."""
        self._require_usable("detach")
        if not self._sync.attached:
            raise DetachedError(f"the {self._kind} model is not attached to a device", where=user_source_line(),
                                fix="only detach an attached (compiled) model")
        if isinstance(self._sync.optimizer, PoptorchOptimizer):
            self._ipu_state.detached()  # upstream reads a PopTorch optimiser's state back
        self._sync.pull(keep_host_writes=True)
        seed = self._sync.device_seed()
        if seed is not None and not self._seed_dirty:
            self._seed = seed  # rng_state keeps reading the device's state while detached
        self._sync.attached = False
        if self._sync.compiled is not None:
            self._sync.compiled.session.free_buffers()  # device memory goes with the device

    def attachToDevice(self) -> None:  # noqa: N802
        """Attach again after ``detachFromDevice``; the host weights are copied to the device."""
        self._require_usable("attach")
        refuse_offline(self.options, self._kind, "attach")
        if self._sync.compiled is None:
            raise DetachedError(f"the {self._kind} model has not been compiled yet", where=user_source_line(),
                                fix="call the model (or model.compile(...)) first")
        if self._sync.attached:
            raise DetachedError(f"the {self._kind} model is already attached", where=user_source_line(),
                                fix="detachFromDevice() first")
        self._sync.attached = True
        self.copyWeightsToDevice()
        if isinstance(self._sync.optimizer, PoptorchOptimizer) and self._sync.optimizer.has_state():
            self._sync.optimizer_dirty = True  # upstream writes the state read at detach (or loaded since)
            self._push_optimizer()
        if self._seed_dirty:
            self._write_seed()
        if self._hypers_pending:  # setOptimizer while detached
            self._hypers_pending = False
            compiled = self._require_compiled()
            compiled.session.write_variables_data(hyper_values(compiled.program, self._sync.plans))

    def report(self, spec: Any = None) -> Any:
        """The compiled program's ``ipuxl.device.report.ProgramReport`` (op counts, code size with
        outlining, call sites, memory per IPU, FLOPs per step; with blocks on several IPUs, each
        IPU's share and the pipeline schedule: ``compile.report.annotate_report``); ``print`` it
        for a table."""
        if self._session is None:
            raise DetachedError("report(): the model has not been compiled yet", where=user_source_line(),
                                fix="call it after the first model(...) call or model.compile(...)")
        return annotate_report(self._session.report(spec), self._require_compiled().program,
                               self.options.device_iterations)

    def isAttachedToDevice(self) -> bool:  # noqa: N802
        """Whether the compiled program holds its (simulated) device; False before compiling."""
        return self._sync.attached

    def isCompiled(self) -> bool:  # noqa: N802
        """Whether the model has been compiled (and not destroyed)."""
        return self._sync.compiled is not None

    # -- the device seed, guards, destroy ----------------------------------------------------
    def _write_seed(self) -> None:
        compiled = self._require_compiled()
        self._seed_dirty = False
        if compiled.program.seed is not None:
            compiled.session.write_variables_data({compiled.program.seed: self._seed})

    def _compiled_for(self, what: str) -> Compiled:
        compiled = self._sync.compiled
        if compiled is None:
            raise ExecutorError(f"{what}: {NO_EXECUTABLE}", where=user_source_line(),
                                fix="call the model (or model.compile(...)) first")
        return compiled

    def destroy(self) -> None:
        """Copy weights to the host, then release the program and the device. As upstream, the
        next call (or ``compile``) compiles the model again, for its inputs then; until then,
        the methods that need a program raise."""
        if self._destroyed:
            return
        if self._sync.compiled is not None and self._sync.attached:
            self._sync.pull(keep_host_writes=True)
        self._sync.release()
        self._destroyed = True
        LIVE.discard(self)

    def _revive(self) -> None:
        """After ``destroy()``: start again from the host's weights and the optimiser (not compiled)."""
        if not self._destroyed:
            return
        old = self._sync
        self._sync = WeightSync(self._model, training=self.training, optimizer=old.optimizer, plans=old.plans)
        weakref.finalize(self, self._sync.pull_weights_if_newer).atexit = False
        self._ipu_state = IpuOptimizerState(self)
        self._ipu_state.adopt(old.optimizer)
        if isinstance(old.optimizer, PoptorchOptimizer) and old.optimizer.has_state():
            self._ipu_state.loaded(old.optimizer.state_dict())
        self._key = self._call = self._format = None
        self._destroyed = False
        LIVE.add(self)

    def _require_usable(self, what: str) -> None:
        if self._destroyed:
            raise DetachedError(f"cannot {what}: the {self._kind} model was destroyed", where=user_source_line(),
                                fix="create a new trainingModel/inferenceModel")

    def _require_attached(self, what: str) -> None:
        if not self._sync.attached:
            raise DetachedError(f"{what}: the {self._kind} model is detached from its device",
                                where=user_source_line(), fix="call attachToDevice() first")

    # -- module-like conveniences ---------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.__dict__["_user_model"], name)

    def __repr__(self) -> str:
        """The wrapped module's ``repr`` (as upstream)."""
        return repr(self._user_model)

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped ``torch.nn.Module`` (the one passed to ``trainingModel``/``inferenceModel``)."""
        return self._user_model

    @property
    def session(self) -> Session | None:
        """The device session of the compiled program (None before the first call)."""
        return self._session

    @property
    def _session(self) -> Session | None:
        compiled = self._sync.compiled
        return compiled.session if compiled is not None else None

    @property
    def _slots(self) -> HostSlots | None:
        """Where each parameter/buffer of the compiled program lives (see ``weights``)."""
        compiled = self._sync.compiled
        return compiled.slots if compiled is not None else None

