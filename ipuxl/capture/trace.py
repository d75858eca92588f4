"""Capture an ``nn.Module`` (PopTorch style) into an fx graph with torch.fx.

``trace_module`` runs the module once on fake tensors under ``make_fx``: every aten
op it executes becomes one fx node, so any module that traces works, not a fixed
list of layers. The traced function is ``functional_call(module, params, buffers,
inputs)`` under ``torch.func.functionalize``, so

* parameters and buffers are *inputs* of the graph (the caller binds them to
  variables), and
* in-place updates of buffers (BatchNorm's running statistics) become *extra
  outputs* holding the new values, which the caller writes back to the variables
  (``capture.mutations``).

The trace runs under ``CaptureMode`` (``capture.mode``): dropout draws from a seed
input (``capture.dropout``), autograd keeps its eager meaning (``capture.grad_mode``),
tensors from outside the module become constants (``capture.constants``) and the
loss is found as PopTorch finds it. A training trace keeps each submodule's own
``training`` flag (``_train_flags``). Errors keep torch's type, and ops whose output
shapes depend on values are refused (``capture.failures``). With ``outline=True`` each kind of
repeated block module is traced once and called (``capture.blocks``). ``precision``
applies PopTorch's float16 rules (``capture.mode.Precision``): with
``float_statistics`` the running statistics of float16 batch norms are inputs (and
updated) in float32.
``capture.to_ir.graph_from_trace`` then imports the result into an ``Ir``.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ipuxl.capture.arguments import FlatCall, flatten_call, forward_source, input_names
from ipuxl.capture.blocks import (
    Blocks, Candidates, NeedBlock, OutlinedBlock, discover_blocks, outline_block, outline_candidates, outlined_blocks,
    used_blocks,
)
from ipuxl.capture.custom_functions import route_custom_functions
from ipuxl.capture.dropout import SEED_DTYPE, SEED_SHAPE, random_op
from ipuxl.capture.failures import note_capture, raised_by_forward, refuse_data_dependent, trace_error
from ipuxl.capture.random_ops import unseeded_op_error
from ipuxl.capture.runtime_checks import materialize_checks
from ipuxl.capture.grad_mode import GradTracker
from ipuxl.capture.matmuls import fold_broadcast_matmuls
from ipuxl.capture.losses import MULTIPLE_LOSSES, NO_LOSS
from ipuxl.capture.mode import CaptureMode, Precision, capturing, find_loss
from ipuxl.capture.module_state import call_with_state
from ipuxl.capture.mutations import extract_mutations
from ipuxl.capture.node_sources import recording_sources
from ipuxl.capture.outputs import flatten_objects
from ipuxl.capture.nodes import output_nodes, placeholders, spec_of
from ipuxl.errors import IpuxlError, TraceError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.meta import ROLE, Role
from ipuxl.ir.tensor import TensorSpec
from ipuxl.kernels.grad_hooks import new_hook, route_grad_hooks

__all__ = ["TracedModule", "trace_module", "parameter_hooks"]

# BatchNorm's aten kernel (``native_batch_norm``) updates its running statistics
# without declaring it, so functionalize cannot see the update. It is replaced by the
# functional form of the same fused kernel, whose new running statistics are copied
# into the buffers visibly (``capture.mutations`` then sees the update); the backward
# is then one ``native_batch_norm_backward`` as in eager, not dozens of small ops.
_aten = torch.ops.aten
_DECOMPOSED_BATCH_NORM = get_decompositions([_aten.native_batch_norm.default])[_aten.native_batch_norm.default]


def _fused_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                      momentum: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``native_batch_norm`` with its running-statistics update made visible (same kernel).

    Statistics of another dtype than the input (float32 statistics of a float16 layer,
    ``runningStatisticsAlwaysFloat``), which torch's CPU kernel refuses, take torch's
    own decomposition into elementwise ops instead."""
    if any(t is not None and t.dtype != input.dtype for t in (weight, bias, running_mean, running_var)):
        return _DECOMPOSED_BATCH_NORM(input, weight, bias, running_mean, running_var, training, momentum, eps)
    if running_mean is None or running_var is None:
        return _aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    if not training:
        return _aten._native_batch_norm_legit_no_training.default(
            input, weight, bias, running_mean.detach(), running_var.detach(), momentum, eps)
    # detached: the kernel has no gradient for the statistics (autodiff differentiates
    # a graph's floating-point inputs, and the buffers are inputs of the module's graph)
    out, mean, rstd, new_mean, new_var = _aten._native_batch_norm_legit_functional.default(
        input, weight, bias, running_mean.detach(), running_var.detach(), True, momentum, eps)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd


# (Keys typed Any: make_fx is annotated with OpOverload keys.)
_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {_aten.native_batch_norm.default: _fused_batch_norm}


@dataclass
class TracedModule:
    """The fx graph of one module call and how its inputs and outputs map back.

    Graph inputs, in order: ``inputs`` (tensor leaves of the call's arguments),
    ``params``, ``buffers``, then the seed (its placeholder's ``ROLE`` is
    ``Role.SEED``; used when ``uses_seed``). Graph outputs: the user's output leaves
    (``out_spec`` rebuilds the structure), then the new values of ``mutated``
    parameters/buffers.
    """

    gm: fx.GraphModule
    name: str
    input_names: list[str]
    input_specs: list[TensorSpec]
    params: list[str]
    buffers: list[str]
    uses_seed: bool
    out_spec: Any
    output_specs: list[TensorSpec]
    loss_index: int | None
    mutated: list[str] = field(default_factory=list)
    # the non-tensor leaves of the call, part of the program (a change means a new trace)
    static_args: tuple = ()
    n_dropouts: int = 0  # dropouts drawn per call (each takes the next seed modifier)
    has_losses: bool = False  # a loss function or identity_loss ran inside
    # positions (in ``inputs``) of the call's tensors written in place; their new values
    # are the last graph outputs, after those of ``mutated``
    mutated_inputs: list[int] = field(default_factory=list)
    # repeated block modules traced once and called from the graph (``outline=True``)
    blocks: list[OutlinedBlock] = field(default_factory=list)

    @property
    def n_outputs(self) -> int:
        return len(self.output_specs)

    @property
    def mutates_inputs(self) -> bool:
        """An in-place write to one of the call's own inputs."""
        return bool(self.mutated_inputs)


def trace_module(module: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                 training: bool, need_loss: bool, outline: bool = False,
                 precision: Precision = Precision()) -> TracedModule:
    """Trace ``module(*args, **kwargs)`` (see the module docstring).

    Args:
        training: trace a training step or an inference step (see ``_train_flags``);
            the modules' own flags are restored afterwards.
        need_loss: find the loss output (``TraceError`` when there is none).
        outline: trace each kind of repeated block module once and record its other
            runs as calls of that trace (see ``capture.blocks``), so capture time and
            graph size grow with the number of distinct blocks, not of blocks.
        precision: PopTorch's float16 rules (``Options.Precision``).

    Raises:
        TraceError: the module cannot be captured, or (``need_loss``) has no single loss.
    """
    with _train_flags(module, training):
        return _trace_module(module, args, kwargs, training=training, need_loss=need_loss, outline=outline,
                             precision=precision)


@contextlib.contextmanager
def _train_flags(module: torch.nn.Module, training: bool) -> Iterator[None]:
    """Each module's ``training`` flag while it is traced, restored after.

    An inference step runs every module in eval mode. A training step keeps each
    submodule's own flag, as PopTorch does: a ``Dropout`` or ``BatchNorm`` the user
    set to ``eval()`` inside a training model stays in eval mode. Only a model that
    is wholly in eval mode (``model.eval()`` before wrapping) is put in train mode.
    """
    flags = {m: m.training for m in module.modules()}
    if not training or not module.training:
        module.train(training)
    try:
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


_MAX_RESTARTS_PER_BLOCK = 4
"""Restarts of a model's trace for new kinds of blocks (each a new input shape or layout of a
block module) beyond this many per candidate module mean runs that never match a traced kind
(a static argument that is new at each run): the model is then traced without outlining."""


def _trace_module(module: torch.nn.Module, args: tuple, kwargs: dict | None, *,
                  training: bool, need_loss: bool, outline: bool, precision: Precision) -> TracedModule:
    """``trace_module`` with the modules' flags already set."""
    candidates = outline_candidates(module) if outline else {}
    blocks: Blocks = {}

    def trace_block(need: NeedBlock) -> OutlinedBlock | None:
        return _trace_block(need, training, candidates, precision)

    if candidates:
        discover_blocks(module, args, kwargs, candidates, blocks, trace_block)
    restarts = 0
    while True:
        try:
            traced = _trace(module, args, kwargs, training=training, need_loss=need_loss,
                            candidates=candidates, blocks=blocks, precision=precision)
        except NeedBlock as need:  # the first run of a kind of block: trace it alone, then start again
            blocks[need.key] = trace_block(need)
            restarts += 1
            if restarts > _MAX_RESTARTS_PER_BLOCK * len(candidates):  # kinds that never repeat: trace inline
                candidates, blocks = {}, {}
            continue
        traced.blocks = used_blocks(traced.gm, blocks)
        return traced


@dataclass
class _ForwardRecord:
    """What the traced forward learnt about its outputs (filled while make_fx runs it)."""

    out_spec: Any = None
    n_dropouts: int = 0
    has_losses: bool = False
    loss_index: int | None = None
    final_losses: int = 0  # losses of the outputs that no other loss uses (``capture.losses``)


def _trace(module: torch.nn.Module, args: tuple, kwargs: dict | None, *, training: bool, need_loss: bool,
           candidates: Candidates, blocks: Blocks, precision: Precision) -> TracedModule:
    """One trace of the whole module (``NeedBlock`` when it meets a kind of block not traced yet)."""
    name = type(module).__name__
    call = flatten_call(module, module.forward, args, kwargs)
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    record = _ForwardRecord()
    fn = _functional_forward(module, call, params, buffers, record, training=training, need_loss=need_loss,
                             candidates=candidates, blocks=blocks, precision=precision)
    example = call.tensors()
    statistics = _half_running_statistics(module) if precision.float_statistics else set()
    gm = _make_fx(fn, module, [t.detach() for t in example], [p.detach() for p in params.values()],
                  [b.detach().float() if n in statistics else b.detach() for n, b in buffers.items()],
                  torch.zeros(SEED_SHAPE, dtype=SEED_DTYPE))
    refuse_data_dependent(gm, name)
    materialize_checks(gm, name)
    fold_broadcast_matmuls(gm)
    _mark_roles(gm)
    mutated, mutated_inputs = extract_mutations(gm, len(example), list(params) + list(buffers))
    _refuse_random_ops(gm, module)
    out_specs = [spec_of(n) for n in output_nodes(gm.graph)]
    traced = TracedModule(
        gm=gm, name=name, input_names=input_names(call.bound),
        input_specs=[TensorSpec(tuple(t.shape), t.dtype) for t in example], params=list(params),
        buffers=list(buffers), uses_seed=record.n_dropouts > 0, out_spec=record.out_spec,
        output_specs=out_specs[:len(out_specs) - len(mutated) - len(mutated_inputs)],
        loss_index=record.loss_index, mutated=mutated, static_args=call.static_leaves(),
        n_dropouts=record.n_dropouts, has_losses=record.has_losses, mutated_inputs=mutated_inputs)
    if need_loss:
        _check_loss(traced, module, record.final_losses)
    return traced


def parameter_hooks(named: Iterable[tuple[str, torch.nn.Parameter]]) -> tuple:
    """What a program compiled for a module knows of its parameters' (``named_parameters()``)
    gradient hooks: a registration or removal since means compiling again."""
    return tuple((name, tuple(map(id, (p._backward_hooks or {}).values())),
                  bool(getattr(p, "_post_accumulate_grad_hooks", None)))
                 for name, p in named if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))


def _hook_parameters(params: dict[str, torch.nn.Parameter], traced: dict[str, torch.Tensor]) -> None:
    """The gradient hooks the module's parameters carry (``register_hook``), marked on their
    traced values (``kernels.grad_hooks``); a hook after accumulation, which would run an
    optimiser inside the backward, is refused."""
    for name, param in params.items():
        if getattr(param, "_post_accumulate_grad_hooks", None):
            raise TraceError(f"parameter '{name}' has a post-accumulate-grad hook "
                             "(register_post_accumulate_grad_hook): ipuxl's step updates the weights itself, after "
                             "the backward, with the optimiser given to the model", where=user_source_line(),
                             fix="remove the hook and pass the optimiser to trainingModel(..., optimizer=...)")
        for hook in (getattr(param, "_backward_hooks", None) or {}).values():
            torch.ops.ipuxl.grad_hook(new_hook(hook, None).key, traced[name])


def _half_running_statistics(module: torch.nn.Module) -> set[str]:
    """Names of the float16 running statistics (``running_mean``/``running_var``) of the
    normalisation layers that track them (``runningStatisticsAlwaysFloat``)."""
    found = set()
    for prefix, sub in module.named_modules():
        if not getattr(sub, "track_running_stats", False):
            continue
        for name, buffer in sub.named_buffers(recurse=False):
            if name in ("running_mean", "running_var") and buffer.dtype == torch.float16:
                found.add(f"{prefix}.{name}" if prefix else name)
    return found


def _functional_forward(module: torch.nn.Module, call: FlatCall, params: dict[str, torch.nn.Parameter],
                        buffers: dict[str, torch.Tensor], record: _ForwardRecord, *, training: bool,
                        need_loss: bool, candidates: Candidates, blocks: Blocks,
                        precision: Precision) -> Callable[..., list[torch.Tensor]]:
    """The function make_fx traces: ``module`` called on the given inputs, parameters,
    buffers and seed under a ``CaptureMode``; returns the output leaves."""
    name = type(module).__name__
    p_names, b_names = list(params), list(buffers)

    def fn(inputs: list[torch.Tensor], p_vals: list[torch.Tensor], b_vals: list[torch.Tensor],
           seed: torch.Tensor) -> list[torch.Tensor]:
        call_args, call_kwargs = call.with_tensors(inputs)
        trainable = [v for n, v in zip(p_names, p_vals) if params[n].requires_grad and v.is_floating_point()]
        mode = CaptureMode(seed, GradTracker(trainable, differentiated=training), precision)
        # a training step differentiates its forward whatever the caller's grad mode
        grad_mode = torch.enable_grad() if training else contextlib.nullcontext()
        if training:
            _hook_parameters(params, dict(zip(p_names, p_vals)))
        with grad_mode, capturing(mode), outlined_blocks(candidates, blocks), recording_sources():
            out = call_with_state(module, {**dict(zip(p_names, p_vals)), **dict(zip(b_names, b_vals))},
                                  call_args, call_kwargs)
        # a forward that returns nothing (it only updates its inputs in place) has no outputs
        flat, record.out_spec = pytree.tree_flatten(flatten_objects(() if out is None else out))
        bad = [type(v).__name__ for v in flat if not isinstance(v, torch.Tensor)]
        if bad:
            raise TraceError(f"{name}.forward returned non-tensor values ({', '.join(bad)})",
                             where=forward_source(module),
                             fix="return tensors (or tuples/lists/dicts of tensors) from forward")
        record.n_dropouts, record.has_losses = mode.n_dropouts, bool(mode.marked or mode.losses)
        if need_loss:
            record.loss_index, record.final_losses = find_loss(flat, mode)
        return flat

    return fn


def _make_fx(fn: Callable[..., list[torch.Tensor]], module: torch.nn.Module, *example: Any) -> fx.GraphModule:
    """make_fx of the functionalized ``fn`` on fake tensors (tensors from outside the
    module become constants: ``capture.constants``)."""
    try:
        with _quiet_fake_tensors(), _use_lazy_graph_module(True):  # its code is generated only if run
            gm = make_fx(torch.func.functionalize(fn, remove="mutations"), tracing_mode="fake",
                         decomposition_table=_DECOMPOSITIONS, _allow_non_fake_inputs=True)(*example)
            route_custom_functions(gm)
            route_grad_hooks(gm)
            return gm
    except (IpuxlError, NeedBlock):  # ipuxl's own errors (a refused op, a misused ipuxl call) as they are
        raise
    except Exception as exc:  # torch raises many kinds while tracing; all mean "cannot capture this"
        if raised_by_forward(exc):  # the user's own exception: itself, as PopTorch lets it through
            note_capture(exc)
            raise
        raise trace_error(type(module).__name__, exc) from exc


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """Silence the fake-tensor logger, which logs every failing meta kernel's traceback: the
    failure itself reaches the user as a ``TraceError`` (``capture.failures``)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _mark_roles(gm: fx.GraphModule) -> None:
    """Record each placeholder's role: the traced function's last argument is the seed."""
    *inputs, seed = placeholders(gm.graph)
    for node in inputs:
        node.meta[ROLE] = Role.INPUT
    seed.meta[ROLE] = Role.SEED


def _trace_block(need: NeedBlock, training: bool, candidates: Candidates, precision: Precision) -> OutlinedBlock | None:
    """Trace one block module alone (see ``capture.blocks.outline_block``)."""
    def example(value: Any) -> Any:  # zeros in the layout of the block's first run (its key includes it)
        if not isinstance(value, torch.Tensor):
            return value
        return torch.zeros_like(torch.empty_strided(value.shape, value.stride(), dtype=value.dtype))

    args, kwargs = pytree.tree_map(example, (need.args, need.kwargs))
    try:
        traced = _trace_module(need.module, args, kwargs, training=training, need_loss=False, outline=False,
                               precision=precision)
    except TraceError:
        return None  # traced inline, where the model's trace reports any real problem
    # the runs discovery counted, else the model's alike modules (each may run on other shapes)
    return outline_block(traced, copies=need.runs or candidates[need.module][1])


def _refuse_random_ops(gm: fx.GraphModule, module: torch.nn.Module) -> None:
    op = random_op(gm)
    if op is not None:
        raise unseeded_op_error(op, type(module).__name__, forward_source(module))


def _check_loss(traced: TracedModule, module: torch.nn.Module, final_losses: int) -> None:
    index = traced.loss_index
    shapes = [s.shape for s in traced.output_specs]
    if final_losses > 1:
        raise TraceError(
            f"{MULTIPLE_LOSSES} Training model {traced.name} returns {final_losses} losses (torch loss functions "
            "or identity_loss) of which none is computed from the others", where=forward_source(module),
            fix="combine them into the one loss to minimise, e.g. "
                "poptorch.identity_loss(loss1 + loss2, reduction='none')")
    if index is None:
        raise TraceError(
            f"{NO_LOSS}: training model {traced.name} returns no loss (outputs of shapes {shapes})",
            where=forward_source(module),
            fix="return the loss from forward, e.g. `return output, loss` with loss from a torch loss "
                "function, or wrap a custom loss with ipuxl.identity_loss(loss, reduction='mean'); "
                "or pass loss=torch.nn.CrossEntropyLoss() to trainingModel")
    if index < 0:
        raise TraceError(
            f"training model {traced.name} returns {-index} tensors that could each be the loss "
            f"(outputs of shapes {shapes})", where=forward_source(module),
            fix="mark the one to minimise with ipuxl.identity_loss(loss, reduction='none')")
    spec = traced.output_specs[index]
    if spec.shape != () or not spec.dtype.is_floating_point:
        raise TraceError(
            f"the loss of {traced.name} (output {index}) must be a float scalar, got shape {spec.shape} "
            f"{spec.dtype}", where=forward_source(module),
            fix="reduce it, e.g. ipuxl.identity_loss(loss, reduction='mean')")
