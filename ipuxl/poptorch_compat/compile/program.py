"""The device program of a PopTorch-style model: the main graph around its forward.

``compile.compile_model`` captures the module, imports it as the forward subgraph
(inputs: the micro-batch, the parameters, the buffers and a seed) and, for training,
differentiates it (``Gradients``); ``build_program`` then builds what a PopXL user
would write by hand for the same model:

* the main graph holds the variables (parameters, buffers, optimiser state, the
  seed, and each *variable* hyperparameter of each param group and the loss scaling
  when variable: PopTorch's variable optimizer attributes, which ``setOptimizer``
  writes without recompiling; constant ones are numbers baked into the program, see
  ``translate.variable_hypers``) and runs the device loop: ``ops.repeat`` of the step
  graph deviceIterations times (``ir.num_host_transfers`` = deviceIterations);
* the step graph takes every variable by reference, loads the combined batch of
  ``gradientAccumulation`` micro-batches, calls forward and grad graphs once per
  micro-batch (one compiled function each, called G times), writes back updated
  buffers, stores every micro-batch's outputs, averages the gradients and applies
  ``ipuxl.optim.rules`` in place.

An inference program loads the batch, calls the eval-mode forward, writes back the
buffers it updates and stores its outputs. A pipelined inference program (``PipelinedExecution``)
runs every device iteration in one step through the stages in pipeline order
(``pipelined.pipelined_inference``; the ``repeat`` then runs once). In both, a tensor input that forward
changes in place gets a device-to-host stream per micro-batch with its new value
(``Program.input_updates``), which the executor copies into the caller's tensor.
Output modes (All/Final/Sum/EveryN) are applied on the host to the per-micro-batch
results (``batching.reduce_outputs``).

With ``replicationFactor(R)`` the IR is an ``Ir(replication=R)``: every replica runs
the same program on its own micro-batches with its own copy of every variable
(weights start equal; buffers such as BatchNorm running statistics stay per
replica, as on IPUs). In training the accumulated gradients are averaged across
replicas (``ops.collectives.replicated_all_reduce`` with op "mean") before the
optimiser update, so all replicas apply the same update and their weights stay
equal. Each replica draws its own random numbers: the seed variable holds one
seed per replica (replica 0's is the seed a single replica would use).

A float16 running statistic traced in float32 (``runningStatisticsAlwaysFloat``:
``poptorch_compat.compile.precision``) has a float32 variable the forward reads and updates
(``Program.float_statistics``); its float16 buffer variable, which the host module
shows, gets each update rounded to float16, and a host write to it (a value the
float32 copy does not round to) is adopted at the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ipuxl.capture.dropout import SEED_DTYPE
from ipuxl.capture.trace import TracedModule
from ipuxl.dtypes import to_numpy_dtype
from ipuxl.ir.context import in_sequence
from ipuxl.ir.grad_info import GradGraphInfo
from ipuxl.ir.graph import Graph
from ipuxl.ir.graph_builder import constant, given_variable, graph_input, variable
from ipuxl.ir.ir import Ir
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream, d2h_stream, h2d_stream
from ipuxl.ir.tensor import Tensor, Variable
from ipuxl.ops import cast, equal, host_load, host_store, where
from ipuxl.ops.call import call, call_with_info, repeat
from ipuxl.ops.collectives import replicated_all_reduce
from ipuxl.ops.random import split_random_seed
from ipuxl.ops.var_updates import copy_var_update_
from ipuxl.optim.rules import RULES, clip_grad_norm
from ipuxl.poptorch_compat.compile.pipelined import pipelined_inference, pipelined_micro_batches
from ipuxl.poptorch_compat.compile.translate import ParamPlan

if TYPE_CHECKING:
    from ipuxl.poptorch_compat.compile.anchors import AnchorPlan, AnchorStreams
    from ipuxl.poptorch_compat.compile.placement import StagePlan

__all__ = ["Program", "Gradients", "StartValues", "build_program", "optimizer_structure", "hyper_values",
           "per_replica_seeds"]


@dataclass
class Gradients:
    """The autodiff step's result (``compile.differentiate``).

    Attributes:
        trained: the parameters the optimiser updates, in traced order: those whose
            gradient eager autograd would give.
        info: the grad graph of the forward (gradient of the loss w.r.t. ``trained``).
    """

    trained: list[str]
    info: GradGraphInfo


@dataclass
class StartValues:
    """What a new program's variables start from.

    Attributes:
        weights: every parameter and buffer, by name.
        states: optimiser state, ``{(param, state): array}``; missing states start at zero.
        seed: the seed variable's value (shape (2,), or (R, 2): one seed per replica),
            used when the module draws random numbers (dropout).
        anchors: the tensors the program also returns (``Options.anchorTensor``; ``anchors``).
    """

    weights: dict[str, np.ndarray]
    states: dict[tuple[str, str], np.ndarray]
    seed: np.ndarray
    anchors: AnchorPlan | None = None


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
    # variable hyperparameters: (param group, rules' name) -> scalar variable (float64 for float64 groups)
    hypers: dict[tuple[int, str], Variable] = field(default_factory=dict)
    loss_scaling: Variable | None = None  # the loss scaling, when variable
    trained: list[str] = field(default_factory=list)
    seed: Variable | None = None
    # the call's tensor inputs written in place: (input position, [stream per micro-batch g])
    input_updates: list[tuple[int, list[DeviceToHostStream]]] = field(default_factory=list)
    # float32 copies of float16 running statistics (``Options.Precision.runningStatisticsAlwaysFloat``)
    float_statistics: dict[str, Variable] = field(default_factory=dict)
    # how the micro-batches' and replicas' gradients combine: "mean" (default) or "sum"
    # (``Options.Training.accumulationAndReplicationReductionType(ReductionType.Sum)``)
    reduction: str = "mean"
    # the anchored tensors' streams (``Options.anchorTensor``), None without anchors
    anchors: AnchorStreams | None = None
    # the model's pipeline stages and their IPUs (``placement.StagePlan``), None without blocks
    stages: StagePlan | None = None

    @property
    def writes_variables(self) -> bool:
        """Whether a run changes variables (weights, buffers, optimiser state, seed)."""
        return self.training or bool(self.traced.mutated) or self.seed is not None


def optimizer_structure(plans: list[ParamPlan]) -> tuple:
    """What a program bakes in from the optimiser: everything but the values of its
    variable hyperparameters (``ParamPlan.variable``)."""
    return tuple((p.name, p.group, p.structure_key(),
                  tuple(sorted((k, v) for k, v in p.hypers.items() if k not in p.variable)),
                  None if "loss_scaling" in p.variable else p.loss_scaling) for p in plans)


def hyper_values(program: Program, plans: list[ParamPlan]) -> dict[Variable, np.ndarray]:
    """The values ``plans`` give the program's hyperparameter variables (for
    ``Session.write_variables_data``)."""
    by_group = {plan.group: plan for plan in plans}
    values = {var: by_group[group].hypers[name] for (group, name), var in program.hypers.items()}
    if program.loss_scaling is not None and plans:
        values[program.loss_scaling] = plans[0].loss_scaling
    return {var: np.asarray(value, to_numpy_dtype(var.spec.dtype)) for var, value in values.items()}


def build_program(ir: Ir, traced: TracedModule, forward: Graph, gradients: Gradients | None, *,
                  micro_batches: int, start: StartValues, plans: list[ParamPlan], reduction: str = "mean",
                  stages: StagePlan | None = None) -> Program:
    """Build the main graph around the imported ``forward`` (see the module docstring).

    Args:
        ir: the IR ``forward`` belongs to (``ir.num_host_transfers`` = deviceIterations:
            the device loop's count).
        gradients: the autodiff step's result (training), or None (inference).
        micro_batches: gradient accumulation G: forward (and grad) calls per step.
        start: the values the program's variables start from.
        plans: ``translate`` plans of the trained parameters (training only), in optimiser order.
        reduction: "mean" (default) or "sum": how the micro-batches' and replicas'
            gradients combine before the optimiser step.
        stages: the model's pipeline stages (``placement.StagePlan``), None without blocks; a pipeline
            runs its micro-batches' stages in pipeline order (``pipelined``).
    """
    program = Program(ir, traced, gradients is not None, micro_batches, [], [], {}, {},
                      trained=gradients.trained if gradients else [], reduction=reduction, stages=stages)
    trained = plans if gradients and gradients.trained else []
    with ir.main_graph:
        _add_variables(program, forward, start)
        _add_optimizer_variables(program, trained, start.states)
        _add_streams(program)
        _add_anchor_streams(program, start.anchors)
        variables = _all_variables(program)
        step = ir.new_subgraph("device_step")
        with step:
            inputs = {v: graph_input(v.shape, v.spec.dtype, v.name, by_ref=True) for v in variables}
        # The step is a program: its ops run in the order built (in-place updates of the
        # weights, buffers and seed come after every read of them; verify_inplace_order holds).
        with step, in_sequence():
            # pipelined inference: one step runs every device iteration through the stages (``pipelined``)
            whole_run = pipelined_inference(program, forward, inputs, ir.num_host_transfers)
            if not whole_run:
                _build_step(program, forward, gradients, trained, inputs)
        repeat(step, 1 if whole_run else ir.num_host_transfers, *variables)
    return program


def _all_variables(program: Program) -> list[Variable]:
    """Every variable of the program, in a fixed order (the step graph's inputs)."""
    found = [*program.params.values(), *program.buffers.values(), *program.float_statistics.values(),
             *program.hypers.values(), *([program.loss_scaling] if program.loss_scaling is not None else []),
             *program.states.values()]
    return found + ([program.seed] if program.seed is not None else [])


def _add_anchor_streams(program: Program, plan: AnchorPlan | None) -> None:
    """A stream per anchored tensor (``anchors``; fails on a name the program lacks)."""
    if plan is not None:
        program.anchors = plan.build_streams(program.params, program.trained, training=program.training,
                                             micro_batches=program.micro_batches)


def _build_step(program: Program, forward: Graph, gradients: Gradients | None, plans: list[ParamPlan],
                inputs: dict[Variable, Tensor]) -> None:
    """One device iteration, in the step graph (``inputs``: each variable's input there)."""
    micro_batches, anchors = program.micro_batches, program.anchors
    _adopt_host_statistics(program, inputs)
    if anchors:
        anchors.store_weights(program.params, inputs)
    loaded = [host_load(stream, name) for stream, name in zip(program.inputs, program.traced.input_names)]
    seeds = _step_seeds(inputs[program.seed] if program.seed is not None else None, micro_batches)
    loss_grad = _loss_gradient(program, forward, plans, inputs) if gradients else None
    grad_sums: list[Tensor] = []
    # PipelinedExecution: the micro-batches' stages run in pipeline order (``pipelined``)
    pipelined = pipelined_micro_batches(program, forward, gradients, loaded, seeds, loss_grad, inputs)
    for g in range(micro_batches):
        grads = (pipelined[g] if pipelined is not None
                 else _micro_batch(program, forward, gradients, loaded, seeds[g], g, loss_grad, inputs))
        if anchors and gradients:
            anchors.store_gradients(g, dict(zip(gradients.trained, grads)))
        grad_sums = list(grads) if g == 0 else [a + b for a, b in zip(grad_sums, grads)]
    if gradients and gradients.trained:
        if program.ir.replication_factor > 1:
            # Data parallelism: every replica applies the mean (or sum) of all replicas' gradients.
            grad_sums = [replicated_all_reduce(g, op="add" if program.reduction == "sum" else "mean") for g in grad_sums]
        divisor = micro_batches if program.reduction == "mean" else 1
        if anchors:
            anchors.store_accumulated(dict(zip(gradients.trained, grad_sums)),
                                      _gradient_scale(program, plans, divisor, inputs))
        _apply_optimizer(program, plans, dict(zip(gradients.trained, grad_sums)), divisor, inputs)
        if anchors:
            anchors.store_updated(program.params, inputs)
            anchors.store_loss_scale(_loss_scale(program, plans, inputs))


def _add_variables(program: Program, forward: Graph, start: StartValues) -> None:
    """A variable per parameter and buffer (dtype of its forward input), and the seed's."""
    traced = program.traced
    n_in, n_state = len(traced.input_names), len(traced.params) + len(traced.buffers)
    params = set(traced.params)
    for name, forward_input in zip(traced.params + traced.buffers, forward.inputs[n_in:n_in + n_state]):
        held = program.params if name in params else program.buffers
        dtype, value = forward_input.spec.dtype, start.weights[name]
        if value.dtype == np.float16 and dtype == torch.float32:  # runningStatisticsAlwaysFloat
            program.float_statistics[name] = variable(value.astype(np.float32), dtype, name=f"{name}.float32")
            dtype = torch.float16
        held[name] = given_variable(value, dtype, name)  # the start values are this program's own copies
    if traced.uses_seed:
        program.seed = _seed_variable(program.ir, start.seed)


def _adopt_host_statistics(program: Program, inputs: dict[Variable, Tensor]) -> None:
    """Each float32 running statistic takes its float16 buffer's value where the two
    differ by more than rounding: the host wrote the buffer (``load_state_dict``...)."""
    for name, precise in program.float_statistics.items():
        shown, kept = inputs[program.buffers[name]], inputs[precise]
        copy_var_update_(kept, where(equal(cast(kept, torch.float16), shown), kept, cast(shown, torch.float32)))


def _add_streams(program: Program) -> None:
    """The host streams: one in per input, one out per output and micro-batch, and one
    out per input written in place and micro-batch."""
    traced, count = program.traced, program.micro_batches
    for name, spec in zip(traced.input_names, traced.input_specs):
        # a scalar input (only without gradient accumulation: batching.split_batch) streams as it is
        shape = (count * spec.shape[0], *spec.shape[1:]) if spec.shape else ()
        program.inputs.append(h2d_stream(shape, spec.dtype, name))
    suffix = [f"_mb{g}" if count > 1 else "" for g in range(count)]
    program.outputs = [[d2h_stream(spec.shape, spec.dtype, f"output{j}{suffix[g]}") for g in range(count)]
                       for j, spec in enumerate(traced.output_specs)]
    program.input_updates = [
        (i, [d2h_stream(traced.input_specs[i].shape, traced.input_specs[i].dtype,
                        f"{traced.input_names[i]}.new{suffix[g]}") for g in range(count)])
        for i in traced.mutated_inputs]


def _loss_gradient(program: Program, forward: Graph, plans: list[ParamPlan],
                   inputs: dict[Variable, Tensor]) -> Tensor:
    """The loss gradient: the loss scaling (1 without), once for all micro-batches."""
    traced = program.traced
    assert traced.loss_index is not None, "a training trace has a loss"
    dtype = forward.outputs[traced.loss_index].spec.dtype
    if program.loss_scaling is not None:
        return cast(inputs[program.loss_scaling], dtype)
    scaling = plans[0].loss_scaling if plans else 1.0
    return constant(np.full((), scaling, to_numpy_dtype(dtype)), dtype)


def _loss_scale(program: Program, plans: list[ParamPlan], inputs: dict[Variable, Tensor]) -> Tensor:
    """The step's loss scaling as a float32 scalar (its variable, or a constant)."""
    if program.loss_scaling is not None:
        return cast(inputs[program.loss_scaling], torch.float32)
    return constant(np.float32(plans[0].loss_scaling if plans else 1.0), torch.float32)


def _micro_batch(program: Program, forward: Graph, gradients: Gradients | None, loaded: list[Tensor],
                 seed: Tensor | None, g: int, loss_grad: Tensor | None,
                 inputs: dict[Variable, Tensor]) -> tuple[Tensor, ...]:
    """Micro-batch ``g``: call forward (and the grad graph), write back updated buffers
    and store the outputs. Returns the gradients of the trained parameters."""
    traced, count = program.traced, program.micro_batches
    xs = [x if count == 1 else x[g * s.shape[0]:(g + 1) * s.shape[0]] for x, s in zip(loaded, traced.input_specs)]
    buffers = [program.float_statistics.get(n, program.buffers[n]) for n in traced.buffers]
    args = xs + [inputs[program.params[n]] for n in traced.params] + [inputs[v] for v in buffers]
    args += [seed] if seed is not None else []
    info = call_with_info(forward, *args)
    outs = info.outputs
    # the outputs go to the host before the backward: the forward's results (a language model's
    # logits) need not outlive it, and the memory plan can give their bytes to the gradients
    for j in range(traced.n_outputs):
        host_store(program.outputs[j][g], outs[j])
    grads: tuple[Tensor, ...] = ()
    if gradients is not None and gradients.trained:
        grads = call(gradients.info.graph, loss_grad, inputs_dict=gradients.info.inputs_dict(info))
    for k, name in enumerate(traced.mutated):  # buffers updated in forward persist, as in eager
        target = program.params[name] if name in program.params else program.buffers[name]
        new = outs[traced.n_outputs + k]
        if name in program.float_statistics:  # the float32 copy, and the float16 buffer the host shows
            copy_var_update_(inputs[program.float_statistics[name]], new)
            new = cast(new, torch.float16)
        copy_var_update_(inputs[target], new)
    first_update = traced.n_outputs + len(traced.mutated)
    for k, (_, streams) in enumerate(program.input_updates):
        host_store(streams[g], outs[first_update + k])
    return grads


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


def _seed_variable(ir: Ir, seed: np.ndarray) -> Variable:
    """The random seed variable: one value, or with replicas one value per replica."""
    replicas = ir.replication_factor
    if replicas == 1:
        return variable(np.asarray(seed, np.int64).reshape(-1), SEED_DTYPE, name="random_seed")
    return variable(per_replica_seeds(seed, replicas), SEED_DTYPE, name="random_seed",
                    replica_grouping=ir.replica_grouping(stride=1, group_size=1))


def _step_seeds(seed: Tensor | None, count: int) -> list[Tensor | None]:
    """Fresh seeds for this step's micro-batches; the variable advances every step
    (the schedule of ``capture.dropout.step_seeds``, which ``DropoutReplay`` replays)."""
    if seed is None:
        return [None] * count
    following, this_step = split_random_seed(seed, 2)
    copy_var_update_(seed, following)
    return [this_step] if count == 1 else list(split_random_seed(this_step, count))


def _add_optimizer_variables(program: Program, plans: list[ParamPlan],
                             initial: dict[tuple[str, str], np.ndarray]) -> None:
    """A scalar variable per variable hyperparameter of each param group (float32; float64
    for a group with float64 parameters, whose eager update takes the Python number in
    double precision), one for the loss scaling when variable, and the state variables of
    each trained parameter's update rule (started from ``initial``, else zeros)."""
    doubles = {plan.group for plan in plans
               if plan.name in program.params and program.params[plan.name].spec.dtype == torch.float64}
    for plan in plans:
        dtype = torch.float64 if plan.group in doubles else torch.float32
        for name in sorted(plan.variable & plan.hypers.keys()):
            if (plan.group, name) not in program.hypers:
                program.hypers[(plan.group, name)] = variable(np.asarray(plan.hypers[name], to_numpy_dtype(dtype)),
                                                              dtype, name=f"optimizer.group{plan.group}.{name}")
    if plans and "loss_scaling" in plans[0].variable:
        program.loss_scaling = variable(np.float32(plans[0].loss_scaling), torch.float32,
                                        name="optimizer.loss_scaling")
    for plan in plans:
        if plan.name not in program.trained:
            continue
        for state, spec in plan.state_specs(program.params[plan.name]).items():
            value = initial.get((plan.name, state))
            if value is None:  # zeros the IR keeps: no memory until the session writes them
                program.states[(plan.name, state)] = given_variable(spec.zeros(), spec.dtype, f"{plan.name}.{state}")
                continue
            data = np.asarray(value, to_numpy_dtype(spec.dtype)).reshape(spec.shape)
            program.states[(plan.name, state)] = variable(data, spec.dtype, name=f"{plan.name}.{state}")


def _apply_optimizer(program: Program, plans: list[ParamPlan], grads: dict[str, Tensor], divisor: int,
                     inputs: dict[Variable, Tensor]) -> None:
    """Each trained parameter's update rule on the mean gradient (loss scaling divided
    out, then clipped to the optimiser's ``max_grad_norm``), on the step graph's inputs
    of its weight, state and learning-rate variables.

    PopART's numerics for a float16 weight with float32 optimiser state (PopTorch's
    default accumulator types): the gradient is cast to float32 *before* the loss
    scaling is divided out, so the rule computes the moments and the update term in
    float32 (``_optimizer_dtype``); only the weight update itself is float16."""
    mean: dict[str, Tensor] = {}
    scale = _gradient_scale(program, plans, divisor, inputs)
    for plan in plans:
        if plan.name in grads:
            grad = grads[plan.name]
            dtype = _optimizer_dtype(program, plan, grad)
            if grad.spec.dtype != dtype:
                grad = cast(grad, dtype)
            mean[plan.name] = grad if isinstance(scale, float) and scale == 1.0 else grad * _as_dtype(scale, grad)
    if plans:
        mean = dict(zip(mean, clip_grad_norm(list(mean.values()), plans[0].max_grad_norm)))
    for plan in plans:
        if plan.name not in mean:
            continue
        hypers = {k: (inputs[program.hypers[(plan.group, k)]] if k in plan.variable else v)
                  for k, v in plan.hypers.items()}
        states = {state: inputs[var] for (name, state), var in program.states.items() if name == plan.name}
        RULES[plan.rule](inputs[program.params[plan.name]], mean[plan.name], **states, **hypers, **plan.flags)


def _optimizer_dtype(program: Program, plan: ParamPlan, grad: Tensor) -> torch.dtype:
    """The dtype the optimiser receives ``plan``'s gradient in: the widest of the gradient's
    and its optimiser states' (the moments, momentum or square averages; not ``step``)."""
    dtype = grad.spec.dtype
    for (name, state), var in program.states.items():
        if name == plan.name and state != "step" and var.spec.dtype.is_floating_point:
            dtype = torch.promote_types(dtype, var.spec.dtype)
    return dtype


def _gradient_scale(program: Program, plans: list[ParamPlan], divisor: int,
                    inputs: dict[Variable, Tensor]) -> float | Tensor:
    """What the summed gradients are multiplied by: ``1 / (divisor * loss_scaling)`` (a
    float32 scalar tensor when the loss scaling is a variable)."""
    if program.loss_scaling is not None:
        return 1.0 / (inputs[program.loss_scaling] * float(divisor))
    return 1.0 / (divisor * (plans[0].loss_scaling if plans else 1.0))


def _as_dtype(scale: float | Tensor, grad: Tensor) -> float | Tensor:
    dtype = grad.spec.dtype
    return scale if isinstance(scale, float) or scale.spec.dtype == dtype else cast(scale, dtype)
