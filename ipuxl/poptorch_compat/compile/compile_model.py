"""``compile_model``: a PopTorch-style model to a device program, in named steps.

Each step is one function of this module, run in this order:

1. ``capture``: trace the module's forward for one micro-batch (``capture.trace``); its
   ops take the stage and IPU of the PopTorch block they ran in (``placement.placement``,
   checked by ``placement.check_depth``);
2. ``import_forward``: import the trace into a new ``Ir`` as the forward subgraph
   (``capture.to_ir``);
3. ``differentiate`` (training): autodiff of the forward for the loss w.r.t. the
   parameters the optimiser trains (``transforms.autodiff``);
4. ``build_program``: variables and host streams in the main graph, and the device
   loop: ``ops.repeat`` of a step graph (loads, a forward (and grad) call per
   micro-batch, stores, the optimiser) deviceIterations times (``program``);
5. ``outline_program`` (``Options.autoOutline``): outline repeated code (``passes.outline``).

The executor then compiles the IR on a device ``Session``.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx

from ipuxl.capture.to_ir import graph_from_trace
from ipuxl.capture.mode import Precision
from ipuxl.capture.module_state import refusing_reassigned_buffers
from ipuxl.capture.trace import TracedModule, trace_module
from ipuxl.ir.graph import Graph
from ipuxl.ir.ir import Ir
from ipuxl.ir.tensor import Tensor
from ipuxl.passes.outline import outline_ir
from ipuxl.poptorch_compat.compile.overlap import check_overlap
from ipuxl.poptorch_compat.compile.placement import check_depth, placement
from ipuxl.poptorch_compat.compile.placement_passes import place_gradients, place_variables
from ipuxl.poptorch_compat.enums import ConnectionType, ReductionType
from ipuxl.poptorch_compat.hardware import check_ipu_count
from ipuxl.poptorch_compat.compile.locations import apply_tensor_locations
from ipuxl.poptorch_compat.options import Options
from ipuxl.poptorch_compat.compile.precision import precision_rules
from ipuxl.poptorch_compat.compile.program import Gradients, Program, StartValues, build_program
from ipuxl.poptorch_compat.compile.translate import ParamPlan
from ipuxl.poptorch_compat.session_options import log_session_options, session_options
from ipuxl.progress import stage
from ipuxl.transforms import autodiff

__all__ = ["compile_model", "capture", "import_forward", "differentiate", "outline_program"]


def compile_model(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], *, training: bool, options: Options,
                  start: StartValues, plans: list[ParamPlan], fixed_buffers: bool = False) -> Program:
    """Build the device program of ``model`` called as ``model(*args, **kwargs)`` on one micro-batch.

    Args:
        training: a training step (loss, gradients, optimiser) or an inference step.
        options: device iterations, gradient accumulation, replication, outlining.
        start: the values the program's variables start from.
        plans: ``translate`` plans of the parameters that take gradients, in optimiser order.
        fixed_buffers: PopTorch's contract: a buffer ``forward`` reassigns is refused with
            upstream's error (ipuxl's own API updates the buffer, as eager PyTorch leaves it).

    Raises:
        TraceError: the module cannot be captured (see ``capture.trace.trace_module``).
        OptionsError: the blocks do not fit the execution strategy (``placement.Placement.finish``).
        ExecutorError: a pipeline with too few micro-batches for its stages (``placement.check_depth``).
    """
    log_session_options(session_options(options))  # as upstream's backend, when it reads the options
    refusing = refusing_reassigned_buffers() if fixed_buffers else contextlib.nullcontext()
    with stage("capture"), placement(options.execution_strategy) as placed, refusing:  # each op's stage and IPU
        traced = capture(model, args, kwargs, training=training, outline=options.auto_outline,
                         precision=precision_rules(options))
    stages = placed.finish(traced.gm)
    check_overlap(traced, options)  # ``set_overlap_for_input/output`` marks, as upstream checks them
    if options.connection_type is not ConnectionType.Never:  # the IPUs this process attaches
        check_ipu_count(options.replicas_per_process() * (stages.num_ipus if stages is not None else 1))
    check_depth(stages, training=training, gradient_accumulation=options.gradient_accumulation,
                device_iterations=options.device_iterations)
    forward = import_forward(traced, options)
    with stage("autodiff") if training else contextlib.nullcontext():
        gradients = differentiate(traced, forward, plans) if training else None
    if stages is not None:
        stages.graphs = [forward]
        if gradients is not None and gradients.trained:
            place_gradients(gradients.info, stages)
            stages.graphs.append(gradients.info.graph)
    program = build_program(forward.ir, traced, forward, gradients, start=start, plans=plans,
                            micro_batches=options.gradient_accumulation if training else 1,
                            reduction=gradient_reduction(options), stages=stages)
    if stages is not None:
        place_variables(program, forward)
    apply_tensor_locations(program, options)  # Options.TensorLocations, in the resource model
    if options.auto_outline:
        with stage("outline"):
            outline_program(program)
    return program


def gradient_reduction(options: Options) -> str:
    """How accumulated and replicated gradients combine: PopTorch's
    ``Training.accumulationAndReplicationReductionType`` (Mean by default, or Sum)."""
    return "sum" if options.Training.accumulation_and_replication_reduction_type == ReductionType.Sum else "mean"


def capture(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], *, training: bool,
            outline: bool, precision: Precision = Precision()) -> TracedModule:
    """Step 1: the fx trace of one call (a training trace must return a loss), under
    ``Options.Precision``'s float16 rules (``precision``)."""
    return trace_module(model, args, kwargs, training=training, need_loss=training, outline=outline,
                        precision=precision)


def import_forward(traced: TracedModule, options: Options) -> Graph:
    """Step 2: a new ``Ir`` (replicas; one host transfer per device iteration, as the
    device loop loads once per iteration) holding the trace as its forward subgraph."""
    ir = Ir(replication=options.total_replicas())
    ir.num_host_transfers = options.device_iterations
    # the IPU's floating-point exceptions: the device reads them there (device.fp_checks)
    checks = options.Precision.floating_point_exceptions
    ir.session_options.enableFloatingPointChecks, ir.session_options.engineOptions = checks
    return graph_from_trace(ir, traced)


def differentiate(traced: TracedModule, forward: Graph, plans: list[ParamPlan]) -> Gradients:
    """Step 3: the grad graph of ``forward``'s loss w.r.t. the parameters it trains."""
    assert traced.loss_index is not None, "a training trace has a loss"
    n_in = len(traced.input_names)
    inputs = dict(zip(traced.params, forward.inputs[n_in:n_in + len(traced.params)]))
    trained = _trained_params(traced, forward, plans, inputs)
    info = autodiff(forward, grads_provided=[forward.outputs[traced.loss_index]],
                    grads_required=[inputs[name] for name in trained])
    return Gradients(trained, info)


def outline_program(program: Program) -> None:
    """Step 5: outline what capture did not (e.g. the optimiser's per-weight updates)."""
    outline_ir(program.ir)


def _trained_params(traced: TracedModule, forward: Graph, plans: list[ParamPlan],
                    inputs: dict[str, Tensor]) -> list[str]:
    """Parameters the optimiser holds whose gradient eager autograd would give: the loss
    reaches them through floating-point values, not through a ``detach`` (``.detach()``,
    ``torch.no_grad()``...: see ``capture.grad_mode``). torch.optim skips the others."""
    assert traced.loss_index is not None
    ancestors: set[fx.Node] = set()
    stack = [forward.outputs[traced.loss_index].node]
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
