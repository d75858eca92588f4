"""``trainingModel`` / ``inferenceModel``: PopTorch's wrappers on ipuxl's IR and device.

A ``PoplarExecutor`` (upstream's class name) owns the user's module, traces it on the
first call (``capture.trace``), builds the program (``program.build_program``) and
runs it on a ``Session``: one call of the wrapper is one ``Session.run`` of
``deviceIterations`` steps over the combined batch.

With ``replicationFactor(R)`` the program runs R data-parallel replicas (see
``program``). The combined batch is laid out as PopART lays out host data,
``[deviceIterations, gradientAccumulation, R, micro-batch, ...]``, and outputs come
back in the same order (PopTorch's per-output-mode shapes: All/EveryN concatenate
every returned micro-batch of every replica; Final/Sum give one result per replica).
Under torchrun (``WORLD_SIZE`` = P > 1) each process feeds and gets back only its
R / P replicas, as each PopTorch process does with PopRun; the weights read back
are replica 0's.

Weights (``poptorch_compat.weights``, README "Weights and checkpoints"): on the CPU
devices the host module's parameters and buffers are the device's storage, so the
module always shows the trained weights; elsewhere the device holds a copy that
reads of the module pull and host writes push, per tensor. The torch optimiser's
``state_dict()``/``load_state_dict()`` read and write the device's optimiser state.
A run that fails in step k keeps steps 1..k-1 (host and device agree; the error
says so). A refused call (a shape that cannot be traced, a changed input dtype)
leaves the compiled program and the weights as they were.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ipuxl.capture.trace import TracedModule, seed_words, trace_module
from ipuxl.device.session import Session, device_for
from ipuxl.dtypes import to_numpy_dtype
from ipuxl.errors import (
    AlreadyWrappedError, BatchSizeError, DetachedError, DeviceError, InvalidArgumentError, OptionsError,
    StreamInputError, TraceError,
)
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.translate import initial_state, translate, write_state
from ipuxl.poptorch_compat.options import Options
from ipuxl.passes.outline import outline_ir
from ipuxl.device.replicas import world
from ipuxl.poptorch_compat.program import Program, build_program, optimizer_structure, reduce_replicated_outputs
from ipuxl.poptorch_compat.weights import (
    HostSlots, install_optimizer_hooks, install_sync_hooks, named_tensors, remove_sync_hooks, to_numpy,
)

__all__ = ["PoplarExecutor", "trainingModel", "inferenceModel"]

_LIVE: "weakref.WeakSet[PoplarExecutor]" = weakref.WeakSet()
_GENERATION = [0]  # bumped when executors come or go (sharing caches are recomputed)


def _bump_generation() -> None:
    _GENERATION[0] += 1


def trainingModel(model: torch.nn.Module, options: Options | None = None,  # noqa: N802 - PopTorch's name
                  optimizer: torch.optim.Optimizer | None = None,
                  loss: Callable[[Any, Any], torch.Tensor] | None = None) -> "PoplarExecutor":
    """Wrap ``model`` for training on the device (PopTorch's ``trainingModel``).

    Args:
        model: an ``nn.Module`` whose forward returns the loss, alone or among its
            outputs (see ``capture.trace`` for how the loss is found).
        options: ``ipuxl.Options`` (device iterations, gradient accumulation,
            output mode, random seed); frozen once the model is compiled.
        optimizer: a ``torch.optim`` SGD/Adam/AdamW/RMSprop or an ``ipuxl.optim``
            optimiser over the model's parameters (default: SGD, lr 0.01, as upstream).
        loss: optional loss function: the model then returns only its output,
            the last input of each call is the target, and the wrapper returns
            ``(output, loss)``.
    """
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    for other in list(_LIVE):
        if other.training and not other._destroyed and other._user_model is model:
            raise AlreadyWrappedError(
                f"the module {type(model).__name__} has already been wrapped in ipuxl.trainingModel",
                where=user_source_line(),
                fix="call destroy() on the existing training model (it copies the weights back) before wrapping "
                    "the module again, or keep using the existing one")
    if optimizer is None and any(p.requires_grad for p in model.parameters()):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return PoplarExecutor(model, options, training=True, optimizer=optimizer, loss=loss)


def inferenceModel(model: torch.nn.Module, options: Options | None = None) -> "PoplarExecutor":  # noqa: N802
    """Wrap ``model`` for inference on the device: eval mode (dropout off, BatchNorm
    running statistics), outputs of every iteration by default (``OutputMode.All``)."""
    return PoplarExecutor(model, options, training=False)


class _WithLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, loss: Callable[[Any, Any], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss

    def forward(self, *args: Any) -> tuple[Any, torch.Tensor]:
        output = self.model(*args[:-1])
        return output, self.loss_fn(output, args[-1])


class PoplarExecutor:
    """A module compiled for the device; call it like the module (see ``trainingModel``)."""

    def __init__(self, model: torch.nn.Module, options: Options | None, *, training: bool,
                 optimizer: torch.optim.Optimizer | None = None, loss: Callable | None = None):
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(f"expected an nn.Module, got {type(model).__name__}",
                                       where=user_source_line(), fix="wrap a torch.nn.Module")
        if options is not None and not isinstance(options, Options):
            raise InvalidArgumentError(f"options must be ipuxl.Options, got {type(options).__name__}",
                                       where=user_source_line(), fix="pass ipuxl.Options()")
        self._user_model = model
        self.model = model if loss is None else _WithLoss(model, loss)
        self.options = options if options is not None else Options()
        self.training = training
        self.optimizer = optimizer
        self._names = {p: n for n, p in torch.nn.Module.named_parameters(self.model)}
        self._plans = translate(optimizer, self._names) if training and optimizer is not None else []
        self._program: Program | None = None
        self._session: Session | None = None
        self._slots: HostSlots | None = None  # where each parameter/buffer lives (see weights)
        self._key: tuple | None = None
        self._attached = False
        self._destroyed = False
        self._weights_newer = False  # device values of copied tensors not yet read back
        self._states_newer = False  # device optimiser state not yet in the torch optimiser
        self._optimizer_dirty = False  # optimizer.load_state_dict since the last run
        self._pulling = False  # copying to the host: reads of the host module must not pull again
        self.compile_count = 0
        self._unsynced_steps = 0  # optimiser steps on the device not yet in the host optimiser's state
        self._seed = _initial_seed(self.options)
        install_sync_hooks(self.model, self)
        self._hooks = install_optimizer_hooks(optimizer, self) if optimizer is not None else []
        self._sharing: tuple[int, list[weakref.ref]] = (-1, [])
        _LIVE.add(self)
        _bump_generation()
        weakref.finalize(self, _bump_generation)

    # -- calling ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._require_usable("call the model")
        micro, stacked, tensors = self._split(args, kwargs)
        self._ensure_program(micro)
        if not self._attached:
            raise DetachedError(f"the {self._kind} model is detached from its device",
                                where=user_source_line(), fix="call model.attachToDevice() before running it")
        self._sync_before_run()
        program = self._program
        try:
            results = self._session.run(dict(zip(program.inputs, stacked)))
        except DeviceError as exc:
            if exc.steps_applied is not None:  # steps ran: the device keeps them (see Session.run)
                self._after_run(exc.steps_applied, partial=True)
            raise
        self._after_run(self.options.device_iterations)
        self._update_inputs(results, tensors)
        return self._outputs(results)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Trace and compile for these inputs without running (PopTorch's ``compile``)."""
        self._require_usable("compile the model")
        micro, _, _ = self._split(args, kwargs)
        self._ensure_program(micro)

    @property
    def _kind(self) -> str:
        return "training" if self.training else "inference"

    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor], list[torch.Tensor]]:
        """Validate the combined batch; return micro-batch example args, stream data and
        the call's tensors.

        The combined batch's first dimension is laid out as PopTorch/PopART lay out
        host data: ``[deviceIterations, gradientAccumulation, replicas, micro-batch]``
        (iterations outermost). Each input stream takes ``(iterations, replicas,
        accumulation x micro-batch, ...)``: one replica's micro-batches of a step are
        consecutive in its stream. Under torchrun a process feeds only its own
        replicas (``replicationFactor / processes`` of them).
        """
        opts = self.options
        replicas = self._replicas_here()
        accumulation = opts.gradient_accumulation if self.training else 1
        if not self.training:
            opts.combined_batch_factor(False)  # refuses gradient accumulation for inference
        n = opts.device_iterations
        factor = n * accumulation * replicas
        leaves, spec = pytree.tree_flatten((args, kwargs))
        micro_leaves, stacked, tensors = [], [], []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                micro_leaves.append(leaf)
                continue
            if leaf.dim() == 0 or leaf.shape[0] % factor:
                got = "a scalar" if leaf.dim() == 0 else f"batch {leaf.shape[0]}"
                size = 0 if leaf.dim() == 0 else leaf.shape[0]
                lower, upper = (size // factor) * factor, (size // factor + 1) * factor
                raise BatchSizeError(
                    f"{self._kind} model input of shape {tuple(leaf.shape)}: {got} does not split into "
                    f"{self._factors(replicas)} = {factor} parts", where=user_source_line(),
                    fix=f"use a batch that is a multiple of {factor}"
                        + (f" (nearest: {lower} or {upper})" if lower else f" (e.g. {upper})")
                        + ", e.g. with ipuxl.DataLoader(options, ...), which combines batches for you")
            micro = leaf.shape[0] // factor
            rest = tuple(leaf.shape[1:])
            micro_leaves.append(_MicroBatch((micro, *rest), leaf.dtype))
            data = leaf.detach()
            if replicas > 1 and accumulation > 1:  # [n, G, R, m] -> [n, R, G, m]
                data = data.reshape(n, accumulation, replicas, micro, *rest).transpose(1, 2)
            host_shape = tuple(d for d in (n, replicas) if d > 1) + (accumulation * micro, *rest)
            stacked.append(data.reshape(host_shape))
            tensors.append(leaf)
        return (tuple(micro_leaves), spec), stacked, tensors

    def _replicas_here(self) -> int:
        """The replicas this process feeds (all of them unless under torchrun)."""
        opts = self.options
        distributed = opts.Distributed
        processes, rank = world()
        if distributed.configured and (distributed.numProcesses, distributed.processId) != (processes, rank):
            raise OptionsError(
                f"Options.Distributed.configureProcessId({distributed.processId}, {distributed.numProcesses}) "
                f"does not match this run: process {rank} of {processes}", where=user_source_line(),
                fix="launch the processes with torchrun (it sets RANK and WORLD_SIZE, which the options read "
                    "by default), or leave configureProcessId out")
        return opts.replicas_per_process()

    def _local_replica_range(self) -> tuple[int, int]:
        """[first, last) global indices of the replicas this process runs."""
        replicas = self._replicas_here()
        rank = world()[1]
        return rank * replicas, (rank + 1) * replicas

    def _factors(self, replicas: int | None = None) -> str:
        opts = self.options
        parts = [f"deviceIterations {opts.device_iterations}"]
        if self.training:
            parts.append(f"gradientAccumulation {opts.gradient_accumulation}")
        processes = opts.Distributed.numProcesses
        if processes > 1:
            parts.append(f"replicationFactor {opts.replication_factor} / {processes} processes "
                         f"(= {replicas} replicas in this process)")
        else:
            parts.append(f"replicationFactor {opts.replication_factor}")
        return "micro-batch x " + " x ".join(parts)

    def _outputs(self, results: dict) -> Any:
        """Outputs per output mode; under torchrun, those of this process's replicas."""
        program = self._program
        n, replicas = self.options.device_iterations, self.options.replication_factor
        first, last = self._local_replica_range()
        per_output = []
        for streams in program.outputs:
            parts = [torch.from_numpy(results[s]).reshape(n, replicas, *s.shape)[:, first:last] for s in streams]
            seq = torch.stack(parts, 1)  # (n, G, local replicas, *shape)
            per_output.append(seq.reshape(n * len(parts), last - first, *streams[0].shape))
        mode = self.options.resolved_output_mode(self.training)
        flat = reduce_replicated_outputs(per_output, mode, self.options.output_return_period)
        return pytree.tree_unflatten(flat, program.traced.out_spec)

    def _update_inputs(self, results: dict, tensors: list[torch.Tensor]) -> None:
        """Write the new values of inputs that ``forward`` changed in place into the
        caller's tensors, every micro-batch in its place of the combined batch (as
        eager ``forward`` on each micro-batch's slice would)."""
        program = self._program
        if not program.input_updates:
            return
        n, replicas = self.options.device_iterations, self.options.replication_factor
        first, last = self._local_replica_range()
        for index, streams in program.input_updates:
            parts = [torch.from_numpy(results[s]).reshape(n, replicas, *s.shape)[:, first:last] for s in streams]
            target = tensors[index]
            with torch.no_grad():
                target.copy_(torch.stack(parts, 1).reshape(target.shape))

    # -- compiling ------------------------------------------------------------------------
    def _ensure_program(self, micro: tuple) -> None:
        opts = self.options
        key = micro  # the micro-batch leaves (shapes, dtypes, static values) and structure
        if self._program is not None and key == self._key:
            return
        if self._program is not None:
            self._check_same_dtypes(key)
            if opts.static_shapes:
                raise TraceError(
                    f"the {self._kind} model was compiled for inputs {_describe(self._key)}, got {_describe(key)}",
                    where=user_source_line(),
                    fix="keep input shapes and dtypes fixed (e.g. drop_last=True in the DataLoader), or "
                        "leave Options.staticShapes off to recompile on a change")
        self._rebuild(micro, key)

    def _check_same_dtypes(self, key: tuple) -> None:
        """Refuse an input whose dtype differs from the compiled program's (PopTorch does too)."""
        old_leaves, new_leaves = self._key[0], key[0]
        if key[1] != self._key[1] or len(old_leaves) != len(new_leaves):
            return
        names = iter(self._program.traced.input_names)
        for old, new in zip(old_leaves, new_leaves):
            if not isinstance(old, _MicroBatch):
                continue
            name = next(names)
            if isinstance(new, _MicroBatch) and new.dtype != old.dtype:
                want = str(old.dtype).replace("torch.", "")
                raise StreamInputError(
                    f"{self._kind} model input '{name}' has dtype {str(new.dtype).replace('torch.', '')}; the model "
                    f"was compiled for {want} (its first call)", where=user_source_line(),
                    fix=f"convert the input, e.g. {name}.to(torch.{want}), or destroy() this model and wrap the "
                        "module again to compile it for the new dtype")

    def _rebuild(self, micro: tuple | None = None, key: tuple | None = None, *,
                 states_from_optimizer: bool = False) -> None:
        """(Re)compile, carrying weights, optimiser state and seed over from a previous program.

        The new program and session are built before the old ones are released, so a
        refused trace (or any failure while building) leaves the model as it was."""
        if micro is None:
            micro, key = self._traced_micro, self._key
        if self._optimizer_dirty:  # a loaded optimizer state dict: its hyperparameters and state
            self._plans = translate(self.optimizer, self._names)
            states_from_optimizer = True
        if self._program is not None:
            self._pull_weights_if_newer()
            states = self._optimizer_states() if states_from_optimizer else self._device_states()
            seed = self._device_seed()
        else:
            states = self._optimizer_states() if self.training else {}
            seed = self._seed
        self._sync_shared_weights()
        traced = self._trace(micro)
        values = {n: to_numpy(t) for n, t in named_tensors(self.model)}
        program = build_program(traced, training=self.training, device_iterations=self.options.device_iterations,
                                 micro_batches=self.options.gradient_accumulation if self.training else 1,
                                 values=values, plans=self._trainable_plans(), states=states, seed=seed,
                                 replication=self.options.replication_factor)
        if self.options.auto_outline:
            outline_ir(program.ir)
        device = device_for(self.options.device_type)
        slots = HostSlots(self.model, {**program.params, **program.buffers}, device=device,
                          bind=self._replicas_here() == 1)
        session = Session(program.ir, self.options.device_type, storage=slots.storage())
        session.__enter__()
        self.options._freeze()
        self._close_session()
        self._session, self._slots, self._attached = session, slots, True
        self._program, self._key, self._traced_micro, self._seed = program, key, micro, seed
        self._weights_newer = self._states_newer = self._optimizer_dirty = False
        self.compile_count += 1

    def _trainable_plans(self) -> list:
        """Plans of the parameters that take gradients (torch.optim skips the others)."""
        params = dict(torch.nn.Module.named_parameters(self.model))
        return [plan for plan in self._plans if params[plan.name].requires_grad]

    def _trace(self, micro: tuple) -> TracedModule:
        leaves, spec = micro
        examples = [torch.empty(v.shape, dtype=v.dtype) if isinstance(v, _MicroBatch) else v for v in leaves]
        args, kwargs = pytree.tree_unflatten(examples, spec)
        return trace_module(self.model, args, kwargs, training=self.training, need_loss=self.training,
                            outline=self.options.auto_outline)

    def _close_session(self) -> None:
        if self._session is not None and self._attached:
            self._session.__exit__(None, None, None)
        self._session = None
        self._attached = False

    # -- weights ------------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's ``state_dict()``, with the device's current weights."""
        return self._user_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load weights into the wrapped module and the device (PopTorch's ``load_state_dict``)."""
        result = self._user_model.load_state_dict(state_dict, strict=strict, assign=assign)
        if self._program is not None and self._attached:
            self._push_host_writes()
        return result

    def copyWeightsToHost(self) -> None:  # noqa: N802 - PopTorch's name
        """Copy the device's weights and buffers (and optimiser state) into the host module."""
        self._require_usable("copy weights to the host")
        if self._program is None:
            return
        self._require_attached("copyWeightsToHost")
        self._pull(keep_host_writes=False)

    def copyWeightsToDevice(self) -> None:  # noqa: N802
        """Copy the host module's weights and buffers to the device."""
        self._require_usable("copy weights to the device")
        if self._program is None:
            return
        self._require_attached("copyWeightsToDevice")
        self._slots.host_writes(self._session)  # picks up replaced tensors
        self._slots.push(self._session)
        self._weights_newer = False

    def _pull(self, *, keep_host_writes: bool) -> None:
        """Device -> host: copied weights, then the optimiser state."""
        self._pulling = True
        try:
            self._slots.pull(self._session, keep_host_writes=keep_host_writes)
            self._weights_newer = False
            self._pull_states()
        finally:
            self._pulling = False

    def _pull_weights_if_newer(self) -> None:
        """Before the host module is read: copy newer device weights back."""
        if self._weights_newer and self._attached and not self._pulling:
            self._pulling = True
            try:
                self._slots.pull(self._session)
                self._weights_newer = False
            finally:
                self._pulling = False

    def _pull_states(self) -> None:
        """Put the device's optimiser state into the torch optimiser (``optimizer.state``)."""
        if not (self._states_newer and self._attached and self.training and self.optimizer is not None):
            return
        params = _params_by_name(self.model)
        by_param: dict[str, dict[str, torch.Tensor]] = {}
        for (p, s), v in self._device_states().items():
            by_param.setdefault(p, {})[s] = torch.from_numpy(v)
        for plan in self._plans:
            mine = by_param.get(plan.name)
            if mine:
                write_state(self.optimizer, params[plan.name], plan, mine, steps_taken=self._unsynced_steps)
        self._unsynced_steps = 0
        self._states_newer = False

    def _pull_state_if_newer(self) -> None:
        """Before ``optimizer.state_dict()``: the device's optimiser state."""
        if not self._pulling:
            self._pulling = True
            try:
                self._pull_states()
            finally:
                self._pulling = False

    def _push_host_writes(self) -> None:
        """Host tensors written since the last sync go to the device (copied ones; bound
        ones are the device storage already)."""
        changed = self._slots.host_writes(self._session)
        if changed:
            self._slots.push(self._session, changed)

    def _sync_shared_weights(self) -> None:
        """Other models holding these tensors put their newer device values on the host."""
        for ref in self._sharing_executors():
            other = ref()
            if other is not None:
                other._pull_weights_if_newer()

    def _sync_before_run(self) -> None:
        self._sync_shared_weights()
        if self._optimizer_dirty:
            self._push_optimizer()
        self._push_host_writes()

    def _after_run(self, steps: int, *, partial: bool = False) -> None:
        """A run applied ``steps`` device iterations (``partial``: an unknown part of one more)."""
        program = self._program
        if program.writes_variables and (steps or partial):
            self._weights_newer = bool(self._slots.copied)
            self._states_newer = bool(program.states)
        if self.training:
            self._unsynced_steps += steps

    def _sharing_executors(self) -> list[weakref.ref]:
        """The other live models holding any of this model's parameters or buffers (weakly)."""
        if self._sharing[0] != _GENERATION[0]:
            mine = {id(t) for _, t in named_tensors(self.model)}
            others = [weakref.ref(other) for other in list(_LIVE) if other is not self and not other._destroyed
                      and mine & {id(t) for _, t in named_tensors(other.model)}]
            self._sharing = (_GENERATION[0], others)
        return self._sharing[1]

    def _device_states(self) -> dict[tuple[str, str], np.ndarray]:
        program = self._program
        if program is None or not program.states:
            return {}
        data = self._session.get_tensors_data(list(program.states.values()))
        return {key: np.array(data[var]) for key, var in program.states.items()}

    def _optimizer_states(self) -> dict[tuple[str, str], np.ndarray]:
        """The torch optimiser's state, as the rules' states (``{(param, state): array}``)."""
        if self.optimizer is None:
            return {}
        params = _params_by_name(self.model)
        states: dict[tuple[str, str], np.ndarray] = {}
        for plan in self._plans:
            for state, value in initial_state(self.optimizer, params[plan.name], plan).items():
                states[(plan.name, state)] = value.detach().cpu().numpy()
        return states

    def _device_seed(self) -> np.ndarray:
        program = self._program
        if program is None or program.seed is None:
            return self._seed
        return np.array(self._session.get_tensor_data(program.seed))

    # -- optimiser ------------------------------------------------------------------------
    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: N802
        """Use ``optimizer``'s hyperparameters from the next call.

        Learning rates are variables of the program: changing them (e.g. from an LR
        scheduler) writes those variables, without recompiling. Other changes
        (momentum, weight decay, optimiser type...) recompile, keeping the state of
        the parameters whose optimiser state still applies.
        """
        self._require_usable("set the optimizer")
        if not self.training:
            raise InvalidArgumentError("setOptimizer on an inference model", where=user_source_line(),
                                       fix="only training models have an optimizer")
        plans = translate(optimizer, self._names)
        if optimizer is not self.optimizer:
            self._pull_state_if_newer()
            for handle in self._hooks:
                handle.remove()
            self._hooks = install_optimizer_hooks(optimizer, self)
        self.optimizer = optimizer
        self._apply_plans(plans)

    def _apply_plans(self, plans: list, *, states_from_optimizer: bool = False) -> None:
        old, self._plans = self._plans, plans
        if self._program is None:
            return
        if optimizer_structure(plans) != optimizer_structure(old):
            self._rebuild(states_from_optimizer=states_from_optimizer)
            return
        self._require_attached("setOptimizer")
        lrs = {self._program.learning_rates[plan.group]: np.float32(plan.hypers["lr"]) for plan in plans}
        updates = {var: np.asarray(v, np.float32) for var, v in lrs.items()}
        if states_from_optimizer:
            states = self._optimizer_states()
            for (name, state), var in self._program.states.items():
                value = states.get((name, state))
                dtype = to_numpy_dtype(var.dtype)
                updates[var] = (np.zeros(var.shape, dtype) if value is None
                                else np.asarray(value, dtype).reshape(var.shape))
        self._session.write_variables_data(updates)

    def _optimizer_loaded(self) -> None:
        """``optimizer.load_state_dict`` ran: its state and hyperparameters win over the device's."""
        self._optimizer_dirty = True
        self._states_newer = False
        self._unsynced_steps = 0

    def _push_optimizer(self) -> None:
        self._optimizer_dirty = False
        self._apply_plans(translate(self.optimizer, self._names), states_from_optimizer=True)

    # -- device ---------------------------------------------------------------------------
    def detachFromDevice(self) -> None:  # noqa: N802
        """Copy weights to the host and release the device (calls then fail until attachToDevice)."""
        self._require_usable("detach")
        if not self._attached:
            raise DetachedError(f"the {self._kind} model is not attached to a device", where=user_source_line(),
                                fix="only detach an attached (compiled) model")
        self._pull(keep_host_writes=True)
        self._attached = False

    def attachToDevice(self) -> None:  # noqa: N802
        """Attach again after ``detachFromDevice``; the host weights are copied to the device."""
        self._require_usable("attach")
        if self._program is None:
            raise DetachedError(f"the {self._kind} model has not been compiled yet", where=user_source_line(),
                                fix="call the model (or model.compile(...)) first")
        if self._attached:
            raise DetachedError(f"the {self._kind} model is already attached", where=user_source_line(),
                                fix="detachFromDevice() first")
        self._attached = True
        self.copyWeightsToDevice()

    def report(self, spec: Any = None) -> Any:
        """The compiled program's ``ipuxl.device.report.ProgramReport`` (op counts, code size with
        outlining, call sites, memory per IPU, FLOPs per step); ``print`` it for a table."""
        if self._session is None:
            raise DetachedError("report(): the model has not been compiled yet", where=user_source_line(),
                                fix="call it after the first model(...) call or model.compile(...)")
        return self._session.report(spec)

    def isAttachedToDevice(self) -> bool:  # noqa: N802
        return self._attached

    def isCompiled(self) -> bool:  # noqa: N802
        return self._program is not None

    def destroy(self) -> None:
        """Copy weights to the host, then release the program; the wrapper can no longer be used."""
        if self._destroyed:
            return
        if self._program is not None and self._attached:
            self._pull(keep_host_writes=True)
        self._close_session()
        self._program = self._slots = None
        self._destroyed = True
        _LIVE.discard(self)
        _bump_generation()
        remove_sync_hooks(self.model, self)
        for handle in self._hooks:
            handle.remove()

    def _require_usable(self, what: str) -> None:
        if self._destroyed:
            raise DetachedError(f"cannot {what}: the {self._kind} model was destroyed", where=user_source_line(),
                                fix="create a new trainingModel/inferenceModel")

    def _require_attached(self, what: str) -> None:
        if not self._attached:
            raise DetachedError(f"{what}: the {self._kind} model is detached from its device",
                                where=user_source_line(), fix="call attachToDevice() first")

    # -- module-like conveniences ---------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.__dict__["model"], name)

    def __repr__(self) -> str:
        return f"PoplarExecutor({self._kind}, {self.model!r})"

    @property
    def session(self) -> Session | None:
        """The device session of the compiled program (None before the first call)."""
        return self._session


# -- helpers -------------------------------------------------------------------------------
def _initial_seed(options: Options) -> np.ndarray:
    seed = options.random_seed
    if seed is None:
        return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64).numpy()
    return seed_words(seed)


class _MicroBatch(tuple):
    """Shape and dtype of one input's micro-batch (hashable, for the compile key)."""

    def __new__(cls, shape: tuple, dtype: torch.dtype) -> "_MicroBatch":
        return super().__new__(cls, (tuple(shape), dtype))

    @property
    def shape(self) -> tuple:
        return self[0]

    @property
    def dtype(self) -> torch.dtype:
        return self[1]


def _describe(key: tuple | None) -> str:
    if key is None:
        return "(none)"
    return ", ".join(f"{list(v.shape)} {str(v.dtype).replace('torch.', '')}" if isinstance(v, _MicroBatch)
                     else repr(v) for v in key[0])


def _params_by_name(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(torch.nn.Module.named_parameters(model))
