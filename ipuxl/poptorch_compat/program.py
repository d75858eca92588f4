"""Build the device program of a PopTorch-style model from the shared IR pieces.

A training program is what a PopXL user would write by hand for the same model:

* the traced module is one subgraph (``capture.trace.graph_from_trace``) whose
  inputs are the micro-batch, the parameters, the buffers and a seed;
* ``transforms.autodiff`` differentiates it for the loss w.r.t. the trained
  parameters (a grad graph plus saved activations);
* the main graph, run once per device iteration (``ir.num_host_transfers`` =
  deviceIterations), loads the combined batch of ``gradientAccumulation``
  micro-batches, calls forward and grad graphs once per micro-batch (one compiled
  function each, called G times), writes back updated buffers, stores every
  micro-batch's outputs, averages the gradients and applies ``ipuxl.optim.rules``
  in place, with each param group's learning rate a variable so that
  ``setOptimizer`` changes it without recompiling.

An inference program loads the batch, calls the eval-mode forward, writes back the
buffers it updates and stores its outputs. In both, a tensor input that forward
changes in place gets a device-to-host stream per micro-batch with its new value
(``Program.input_updates``), which the executor copies into the caller's tensor. Output modes (All/Final/Sum/EveryN) are applied on the host to the
per-micro-batch results (``reduce_outputs``).

With ``replicationFactor(R)`` the IR is an ``Ir(replication=R)``: every replica runs
the same program on its own micro-batches with its own copy of every variable
(weights start equal; buffers such as BatchNorm running statistics stay per
replica, as on IPUs). In training the accumulated gradients are averaged across
replicas (``ops.collectives.replicated_all_reduce`` with op "mean") before the
optimiser update, so all replicas apply the same update and their weights stay
equal. Each replica draws its own random numbers: the seed variable holds one
seed per replica (replica 0's is the seed a single replica would use).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from ipuxl.ir.graph_builder import constant, variable
from ipuxl.capture.trace import SEED_DTYPE, TracedModule, graph_from_trace
from ipuxl.dtypes import to_numpy_dtype
from ipuxl.ir.context import in_sequence
from ipuxl.ir.ir import Ir
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream, d2h_stream, h2d_stream
from ipuxl.ir.tensor import Tensor, Variable
from ipuxl.ops import host_load, host_store
from ipuxl.ops.call import call, call_with_info
from ipuxl.ops.collectives import replicated_all_reduce
from ipuxl.ops.random import split_random_seed
from ipuxl.ops.var_updates import copy_var_update_
from ipuxl.optim.rules import RULES, state_specs
from ipuxl.poptorch_compat.options import OutputMode
from ipuxl.transforms import autodiff

__all__ = ["Program", "build_program", "reduce_outputs", "reduce_replicated_outputs", "optimizer_structure",
           "per_replica_seeds"]


@dataclass
class Program:
    """An IR built for one input signature plus the handles the executor needs."""

    ir: Ir
    traced: TracedModule
    training: bool
    micro_batches: int  # gradient accumulation G (1 for inference)
    inputs: list[HostToDeviceStream]
    outputs: list[list[DeviceToHostStream]]  # [user output j][micro-batch g]
    params: dict[str, Variable]
    buffers: dict[str, Variable]
    states: dict[tuple[str, str], Variable] = field(default_factory=dict)
    learning_rates: dict[int, Variable] = field(default_factory=dict)
    trained: list[str] = field(default_factory=list)
    seed: Variable | None = None
    structure: tuple = ()
    replication: int = 1
    # the call's tensor inputs written in place: (input position, [stream per micro-batch g])
    input_updates: list[tuple[int, list[DeviceToHostStream]]] = field(default_factory=list)

    @property
    def writes_variables(self) -> bool:
        """Whether a run changes variables (weights, buffers, optimiser state, seed)."""
        return self.training or bool(self.traced.mutated) or self.seed is not None


def optimizer_structure(plans: list[Any]) -> tuple:
    """What a program bakes in from the optimiser: everything but the learning rates."""
    return tuple((p.name, p.group, p.structure_key(), tuple(sorted((k, v) for k, v in p.hypers.items() if k != "lr")),
                  p.loss_scaling) for p in plans)


def build_program(traced: TracedModule, *, training: bool, device_iterations: int, micro_batches: int,
                  values: dict[str, np.ndarray], plans: list[Any] | None = None,
                  states: dict[tuple[str, str], np.ndarray] | None = None,
                  seed: np.ndarray | None = None, replication: int = 1) -> Program:
    """Build the IR (see the module docstring).

    Args:
        values: initial value of every parameter and buffer, by name.
        plans: ``optim.translate`` plans (training only), in optimiser order.
        states: optimiser state values to start from, ``{(param, state): array}``;
            missing states start at zero.
        seed: the seed variable's initial value (shape (2,), or (R, 2): one seed per
            replica), used when the module draws random numbers (dropout).
        replication: the number of data-parallel replicas R (``Ir(replication=R)``).
    """
    ir = Ir(replication=replication)
    ir.num_host_transfers = device_iterations
    fwd = graph_from_trace(ir, traced)
    n_in, n_params = len(traced.input_names), len(traced.params)
    param_inputs = dict(zip(traced.params, fwd.inputs[n_in:n_in + n_params]))
    plans = list(plans or [])
    trained = _trained_params(traced, fwd, plans, param_inputs) if training else []
    if training:
        loss = fwd.outputs[traced.loss_index]
        grad_info = autodiff(fwd, grads_provided=[loss], grads_required=[param_inputs[n] for n in trained])
    g_count = micro_batches
    program = Program(ir, traced, training, g_count, [], [], {}, {}, trained=trained,
                      structure=optimizer_structure(plans), replication=replication)
    # The step is a program: its ops run in the order built (in-place updates of the
    # weights, buffers and seed come after every read of them; verify_inplace_order holds).
    with ir.main_graph, in_sequence():
        state_inputs = fwd.inputs[n_in:n_in + n_params + len(traced.buffers)]
        for name, graph_input in zip(traced.params + traced.buffers, state_inputs):
            dict_ = program.params if name in param_inputs else program.buffers
            dict_[name] = variable(values[name], graph_input.dtype, name=name, downcast=False)
        if traced.uses_seed:
            program.seed = _seed_variable(ir, seed)
        loaded = []
        for name, spec in zip(traced.input_names, traced.input_specs):
            stream = h2d_stream((g_count * spec.shape[0], *spec.shape[1:]), spec.dtype, name)
            program.inputs.append(stream)
            loaded.append(host_load(stream, name))
        suffix = [f"_mb{g}" if g_count > 1 else "" for g in range(g_count)]
        program.outputs = [[d2h_stream(spec.shape, spec.dtype, f"output{j}{suffix[g]}") for g in range(g_count)]
                           for j, spec in enumerate(traced.output_specs)]
        program.input_updates = [
            (i, [d2h_stream(traced.input_specs[i].shape, traced.input_specs[i].dtype,
                            f"{traced.input_names[i]}.new{suffix[g]}") for g in range(g_count)])
            for i in traced.mutated_inputs]
        seeds = _step_seeds(program.seed, g_count)
        if training:  # the loss gradient: the loss scaling (1 without), once for all micro-batches
            scaling = plans[0].loss_scaling if plans else 1.0
            loss_grad = constant(np.full((), scaling, to_numpy_dtype(loss.dtype)), loss.dtype)
        grad_sums: list[Tensor] = []
        for g in range(g_count):
            xs = [x if g_count == 1 else x[g * s.shape[0]:(g + 1) * s.shape[0]]
                  for x, s in zip(loaded, traced.input_specs)]
            args = xs + [program.params[n] for n in traced.params] + [program.buffers[n] for n in traced.buffers]
            args += [seeds[g]] if traced.uses_seed else []
            info = call_with_info(fwd, *args)
            outs = info.outputs
            if training:
                grads = call(grad_info.graph, loss_grad, inputs_dict=grad_info.inputs_dict(info)) if trained else ()
                grad_sums = list(grads) if g == 0 else [a + b for a, b in zip(grad_sums, grads)]
            for k, name in enumerate(traced.mutated):  # buffers updated in forward persist, as in eager
                target = program.params.get(name, program.buffers.get(name))
                copy_var_update_(target, outs[traced.n_outputs + k])
            for j in range(traced.n_outputs):
                host_store(program.outputs[j][g], outs[j])
            first_update = traced.n_outputs + len(traced.mutated)
            for k, (_, streams) in enumerate(program.input_updates):
                host_store(streams[g], outs[first_update + k])
        if training and trained and replication > 1:
            # Data parallelism: every replica applies the mean of all replicas' gradients.
            grad_sums = [replicated_all_reduce(g, op="mean") for g in grad_sums]
        if training and trained:
            _apply_optimizer(program, plans, dict(zip(trained, grad_sums)), g_count, states or {})
    return program


def _trained_params(traced: TracedModule, fwd: Any, plans: list[Any], inputs: dict[str, Tensor]) -> list[str]:
    """Parameters the optimiser holds whose gradient eager autograd would give: the loss
    reaches them through floating-point values, not through a ``detach`` (``.detach()``,
    ``torch.no_grad()``...: see ``capture.grad_mode``). torch.optim skips the others."""
    loss_node = fwd.outputs[traced.loss_index].node
    ancestors: set[fx.Node] = set()
    stack = [loss_node]
    while stack:
        node = stack.pop()
        if node in ancestors:
            continue
        ancestors.add(node)
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            continue
        stack.extend(n for n in node.all_input_nodes if _carries_gradient(n))
    held = {p.name for p in plans}
    return [name for name in traced.params if name in held and inputs[name].node in ancestors
            and inputs[name].dtype.is_floating_point]


def _carries_gradient(node: fx.Node) -> bool:
    """A node whose value can carry a gradient: floating point (or a call's tuple of outputs)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype.is_floating_point or val.dtype.is_complex
    return True


def per_replica_seeds(seed: np.ndarray, replication: int) -> np.ndarray:
    """One seed per replica, shaped (R, 2): replica 0 keeps ``seed``, the others derive
    theirs from it (``seed`` already shaped (R, 2) is returned as it is)."""
    seed = np.asarray(seed, np.int64)
    if seed.ndim == 2:
        if seed.shape[0] != replication:
            raise ValueError(f"{seed.shape[0]} seeds for {replication} replicas")
        return seed
    base = torch.from_numpy(seed.copy())
    rows = [base] + [torch.ops.ipuxl.modify_seed(base, 0x10000 + r) for r in range(1, replication)]
    return torch.stack(rows).numpy().astype(np.int64)


def _seed_variable(ir: Ir, seed: np.ndarray | None) -> Variable:
    """The random seed variable: one value, or with replicas one value per replica."""
    replicas = ir.replication_factor
    if replicas == 1:
        return variable(np.asarray(seed, np.int64).reshape(-1), SEED_DTYPE, name="random_seed")
    return variable(per_replica_seeds(seed, replicas), SEED_DTYPE, name="random_seed",
                    replica_grouping=ir.replica_grouping(stride=1, group_size=1))


def _step_seeds(seed: Variable | None, count: int) -> list[Tensor | None]:
    """Fresh seeds for this step's micro-batches; the variable advances every step
    (the schedule of ``capture.trace.step_seeds``, which ``DropoutReplay`` replays)."""
    if seed is None:
        return [None] * count
    following, this_step = split_random_seed(seed, 2)
    copy_var_update_(seed, following)
    return [this_step] if count == 1 else list(split_random_seed(this_step, count))


def _apply_optimizer(program: Program, plans: list[Any], grads: dict[str, Tensor], micro_batches: int,
                     initial: dict[tuple[str, str], np.ndarray]) -> None:
    for plan in plans:
        if plan.group not in program.learning_rates:
            program.learning_rates[plan.group] = variable(np.float32(plan.hypers["lr"]), torch.float32,
                                                          name=f"optimizer.group{plan.group}.lr")
    for plan in plans:
        if plan.name not in grads:
            continue
        weight = program.params[plan.name]
        grad = grads[plan.name]
        scale = 1.0 / (micro_batches * plan.loss_scaling)
        if scale != 1.0:
            grad = grad * scale
        hypers = {k: v for k, v in plan.hypers.items() if k != "lr"}
        specs = state_specs(plan.rule, weight, **hypers, **plan.flags, **plan.state_dtypes)
        state_vars = {}
        for state, spec in specs.items():
            value = initial.get((plan.name, state))
            data = spec.zeros() if value is None else np.asarray(value, to_numpy_dtype(spec.dtype)).reshape(spec.shape)
            state_vars[state] = variable(data, spec.dtype, name=f"{plan.name}.{state}")
            program.states[(plan.name, state)] = state_vars[state]
        RULES[plan.rule](weight, grad, **state_vars, lr=program.learning_rates[plan.group], **hypers, **plan.flags)


def reduce_outputs(per_step: list[torch.Tensor], mode: OutputMode, period: int) -> list[torch.Tensor]:
    """Apply an output mode to each output's per-micro-batch results.

    Each entry is shaped ``(steps, *shape)`` (one replica) or ``(steps, R, *shape)``
    with replicas: ``steps`` = deviceIterations x gradientAccumulation micro-batches
    in order, R replicas each. As upstream (PopART's anchor shapes
    ``[batches, accumulation, replicas, *shape]`` flattened into the first dim):

    * All: every micro-batch of every replica, concatenated along the first
      dimension in the input order (iterations, then accumulation, then replicas);
      scalars become a ``(steps * R,)`` vector;
    * EveryN: micro-batches N-1, 2N-1, ... of each replica, concatenated as in All;
    * Final: the last micro-batch; Sum: the element-wise sum over the micro-batches.
      With R > 1 replicas, one result per replica concatenated along the first
      dimension (a scalar becomes an ``(R,)`` vector); with one, it keeps its shape.
    """
    return [_reduce_output(seq, mode, period) for seq in per_step]


def reduce_replicated_outputs(per_step: list[torch.Tensor], mode: OutputMode, period: int) -> list[torch.Tensor]:
    """``reduce_outputs`` of results shaped ``(steps, R, *shape)`` (see there)."""
    return [_reduce_output(seq, mode, period, replicated=True) for seq in per_step]


def _reduce_output(seq: torch.Tensor, mode: OutputMode, period: int, replicated: bool = False) -> torch.Tensor:
    if not replicated:
        seq = seq.unsqueeze(1)
    replicas = seq.shape[1]
    if mode == OutputMode.EveryN:
        seq = seq[period - 1::period]
    if mode in (OutputMode.All, OutputMode.EveryN):
        return _flatten_batch(seq.reshape(seq.shape[0] * replicas, *seq.shape[2:]))
    if mode == OutputMode.Final:
        per_replica = seq[-1]
    elif mode == OutputMode.Sum:
        per_replica = seq.sum(0)
    else:
        raise ValueError(f"unresolved output mode {mode}")
    return per_replica[0] if replicas == 1 else _flatten_batch(per_replica)


def _flatten_batch(seq: torch.Tensor) -> torch.Tensor:
    """``(k, *shape)`` results -> concatenated along the first dim (scalars: a (k,) vector)."""
    return seq if seq.dim() == 1 else seq.reshape(seq.shape[0] * seq.shape[1], *seq.shape[2:])
