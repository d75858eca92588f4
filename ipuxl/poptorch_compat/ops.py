"""PopTorch's ops (``poptorch.for_loop``, ``cond``, ``ipu_print_tensor``, ``CPU``...) on ipuxl.

Each function takes upstream's arguments, defaults and checks, and works both
eagerly (plain PyTorch) and inside a ``trainingModel``/``inferenceModel`` forward,
where make_fx records the torch ops it runs. How each maps onto the simulated IPU:

* ``for_loop`` is unrolled while tracing (``count`` copies of the body in the
  program); ``cond`` computes both branches and selects (``torch.where``);
* ``ipu_print_tensor`` and ``CPU`` are torch custom ops (``ipuxl.kernels``) that the
  device runs, so they print / call the host every time the program runs;
* ``custom_op`` runs a Python implementation registered with ``register_custom_op``;
* the hints that only steer Poplar (``set_available_memory``, ``serializedMatMul``'s
  mode, ``set_overlap_for_*``, ``recomputationCheckpoint``, ``MultiConv``,
  ``NameScope``) check their arguments as PopTorch does and change nothing.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from ipuxl.capture.grad_mode import REACHES
from ipuxl.capture.mode import active_mode, identity_loss
from ipuxl.errors import OpArgumentError, OpContextError
from ipuxl.ir.context import user_source_line
from ipuxl.kernels import cluster, ctc_decoder, host_callbacks  # the first two register torch.ops.ipuxl.*
from ipuxl.kernels.poplar_print import FLOAT_FORMATS
from ipuxl.poptorch_compat.enums import MatMulSerializationMode, MultiConvPlanType, OverlapMode

__all__ = [
    "for_loop", "cond", "dynamic_slice", "dynamic_update", "ipu_print_tensor", "nop", "recomputationCheckpoint",
    "serializedMatMul", "set_available_memory", "set_overlap_for_input", "set_overlap_for_output", "MultiConv",
    "NameScope", "CPU", "custom_op", "register_custom_op", "identity_loss", "ctc_beam_search_decoder",
    "fps", "nearest",
]

Tensors = list[torch.Tensor]


def _bad(what: str, fix: str) -> OpArgumentError:
    return OpArgumentError(what, where=user_source_line(), fix=fix)


def _check_tensor(value: Any, what: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise _bad(f"{what} {type(value)} is not supported.", "pass a torch.Tensor")


def _as_list(outputs: Any) -> list[Any]:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _spec(t: Any) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


# -- control flow ------------------------------------------------------------------------------
def for_loop(count: int, body: Callable[..., Any], inputs: Tensors) -> Tensors:
    """Run ``body`` ``count`` times, each iteration's outputs being the next one's inputs.

    As PopTorch: ``inputs`` is a list of tensors passed by value (the caller's tensors
    are never changed), and the body returns as many tensors as it takes, with the
    same shapes and dtypes. Returns the last outputs as a list.

    ipuxl unrolls the loop while tracing (the program holds ``count`` copies of the
    body), so it also differentiates it: PopTorch refuses ``for_loop`` in training,
    ipuxl trains through it with eager PyTorch's gradients.

    Raises:
        OpArgumentError: ``inputs`` is not a list of tensors, ``count`` is not an int
            >= 0, or the body's outputs do not match its inputs.
    """
    fix = "pass the loop inputs as a list of tensors, e.g. poptorch.for_loop(n, body, [x, y])"
    if not isinstance(inputs, list):
        raise _bad("poptorch.for_loop expects input tensors (inputs) to be a list of tensors. (Object is not list)",
                   fix)
    for ind, tensor in enumerate(inputs):
        if not isinstance(tensor, torch.Tensor):
            raise _bad("poptorch.for_loop expects input tensors (inputs) to be a list of tensors. (Object contained "
                       f"in list at index {ind} is not torch.tensor)", fix)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise _bad(f"poptorch.for_loop: count must be an int >= 0, got {count!r}", "pass the number of iterations")
    state = list(inputs)
    for iteration in range(count):
        outputs = _as_list(body(*[t.clone() for t in state]))  # by value: the body may write its inputs
        _check_loop_outputs(state, outputs, iteration)
        state = outputs
    return [t.clone() for t in state] if count == 0 else state


def _check_loop_outputs(inputs: Tensors, outputs: list[Any], iteration: int) -> None:
    expected, got = [_spec(t) for t in inputs], [_spec(t) for t in outputs]
    if expected != got:
        raise _bad(f"poptorch.for_loop: the body must return tensors matching its inputs in number, shape and "
                   f"dtype; it takes {expected} but returned {got} (iteration {iteration})",
                   "return one tensor per loop input, each of that input's shape and dtype")


def cond(condition: torch.Tensor | bool, then_body: Callable[..., Any], then_inps: list[Any],
         else_body: Callable[..., Any], else_inps: list[Any]) -> Tensors:
    """``then_body(*then_inps)`` if ``condition`` else ``else_body(*else_inps)``, as a list of tensors.

    As PopTorch: ``condition`` is a one-element tensor (or a bool); inputs are passed by
    copy; the branches may use tensors of the caller; both return the same number of
    tensors. In a traced model ipuxl runs both branches and selects each output with
    ``torch.where``, so corresponding outputs must have one shape and dtype, and side
    effects of both branches (prints, CPU ops) happen. As in PopTorch, ``cond`` is for
    inference: a cond whose outputs a training model differentiates raises.

    Raises:
        OpArgumentError: the inputs are not lists, the condition has more than one
            element, or the branches' outputs do not correspond.
        OpContextError: a training model differentiates through the cond.
    """
    if not isinstance(then_inps, list) or not isinstance(else_inps, list):
        raise _bad("poptorch.cond expects then_inps and else_inps tensors to be a list of tensors. "
                   "(Object is not list)", "pass the branch inputs as lists, e.g. [x] (or [] for none)")
    if active_mode() is None or not isinstance(condition, torch.Tensor):
        taken = then_body(*then_inps) if condition else else_body(*else_inps)
        return _as_list(taken)
    if condition.numel() != 1:
        raise _bad(f"poptorch.cond: the condition must have one element, got shape {tuple(condition.shape)}",
                   "reduce the condition to one boolean, e.g. cond.all() or cond.any()")
    then_out, else_out = _as_list(then_body(*_by_copy(then_inps))), _as_list(else_body(*_by_copy(else_inps)))
    _check_branches(then_out, else_out)
    _refuse_differentiated(then_out + else_out)
    pick = condition.reshape(()).to(torch.bool)
    return [torch.where(pick, a, b) for a, b in zip(then_out, else_out)]


def _by_copy(values: list[Any]) -> list[Any]:
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


def _check_branches(then_out: list[Any], else_out: list[Any]) -> None:
    then_specs, else_specs = [_spec(t) for t in then_out], [_spec(t) for t in else_out]
    if len(then_out) != len(else_out):
        raise _bad(f"poptorch.cond: then_body and else_body have to return the same number of outputs; then_body "
                   f"returned {len(then_out)} ({then_specs}), else_body {len(else_out)} ({else_specs})",
                   "return the same number of tensors from both branches")
    if then_specs != else_specs or not all(isinstance(t, torch.Tensor) for t in then_out + else_out):
        raise _bad(f"poptorch.cond: corresponding outputs of then_body and else_body must be tensors of one shape "
                   f"and dtype (ipuxl selects between them); then_body returned {then_specs}, else_body "
                   f"{else_specs}", "cast or reshape the outputs so that both branches return the same specs")


def _differentiated(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a training trace differentiates through one of ``tensors`` (a trained
    parameter's gradient would reach it, see ``capture.grad_mode``)."""
    mode = active_mode()
    grads = mode.grads if mode is not None else None
    return grads is not None and any(grads.flags(t) & REACHES for t in tensors)


def _refuse_differentiated(outputs: Tensors) -> None:
    if _differentiated(outputs):
        raise OpContextError("poptorch.cond() is only supported in inference (its outputs depend on trained "
                             "parameters here)", where=user_source_line(),
                             fix="use poptorch.cond in an inferenceModel, or compute both branches and select "
                                 "with torch.where in a training model")


# -- slicing -----------------------------------------------------------------------------------
def _slice_start(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int, op: str) -> torch.Tensor:
    """The runtime start as a 0-d long tensor clamped so that ``size`` elements fit in ``dim``."""
    if size == 0:
        raise _bad(f"{op}: The start and end of a slice must be different.", "slice at least one element")
    if size < 0:
        raise _bad(f"{op}: Taking a slice of a tensor with the end less than the start is not supported.",
                   "pass a positive size")
    if size > tensor.shape[dim]:
        raise _bad(f"{op}: the slice size ({size}) is larger than dimension {dim} ({tensor.shape[dim]})",
                   "slice at most the whole dimension")
    if start.numel() != 1 or start.is_floating_point():
        raise _bad(f"{op}: the start must be an integer tensor with one element, got {_spec(start)}",
                   "pass e.g. torch.tensor([i])")
    return start.reshape(()).long().clamp(0, tensor.shape[dim] - size)


def _check_dim(tensor: torch.Tensor, dim: Any, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise _bad(f"{op}: Dimension must be an integer.", "pass dim as an int")
    if not -tensor.dim() <= dim < tensor.dim():
        raise _bad(f"{op}: dimension {dim} is out of range for a tensor of rank {tensor.dim()}",
                   f"pass a dim in [{-tensor.dim()}, {tensor.dim() - 1}]")
    return dim % tensor.dim()


def dynamic_slice(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int, step: int) -> torch.Tensor:
    """``tensor[start:start+size:step]`` along ``dim``, ``start`` a tensor read at run time.

    As PopTorch, ``size`` and ``step`` are ints and ``size`` must divide the length of
    ``dim``. A start that would run past the end is clamped to ``length - size``.
    """
    op = "dynamic_slice"
    _check_tensor(tensor, "dynamic_slice must take a torch.tensor input.")
    dim = _check_dim(tensor, dim, op)
    _check_tensor(start, "Slice start argument to dynamic_slice must be a torch.tensor.")
    if isinstance(size, bool) or not isinstance(size, int):
        raise _bad("dynamic_slice: Size must be an integer.", "pass size as an int")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise _bad(f"dynamic_slice: Step must be an integer >= 1, got {step!r}.", "pass step as an int >= 1")
    first = _slice_start(tensor, dim, start, size, op)
    if tensor.shape[dim] % size:
        raise _bad(f"The size of the slice ({size}) must be a factor of the slicing dimension "
                   f"({tensor.shape[dim]}).", "choose a size that divides the dimension")
    return tensor.index_select(dim, first + torch.arange(0, size, step, device=tensor.device))


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor,
                   size: int) -> torch.Tensor:
    """A copy of ``input`` with ``input[start:start+size] = src`` along ``dim`` (``start`` read at
    run time, clamped so that the slice fits)."""
    op = "dynamic_update"
    _check_tensor(input, "dynamic_update must take a torch.tensor input.")
    dim = _check_dim(input, dim, op)
    _check_tensor(start, "Slice start argument to dynamic_update must be a torch.tensor.")
    _check_tensor(src, "Src argument to dynamic_update must be a torch.tensor.")
    if isinstance(size, bool) or not isinstance(size, int):
        raise _bad("dynamic_update: Size must be an integer.", "pass size as an int")
    if input.dim() != src.dim():
        raise _bad(f"input and src tensors must have same dimensionality. ({input.dim()}) vs ({src.dim()})",
                   "give src the rank of input")
    if input.dtype != src.dtype:
        raise _bad(f"input and src tensor must have same dtype. ({input.dtype} vs {src.dtype})",
                   "cast src to input's dtype")
    first = _slice_start(input, dim, start, size, op)
    if src.shape[dim] != size:
        raise _bad(f"dynamic_update: src has {src.shape[dim]} elements along dim {dim}, the slice {size}",
                   "make src's length along dim equal to size")
    return input.index_copy(dim, first + torch.arange(size, device=input.device), src)


# -- decoding ------------------------------------------------------------------------------------
def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0, beam_width: int = 100,
                            top_paths: int = 1) -> Tensors:
    """The ``top_paths`` most probable label sequences of CTC log-probabilities, by beam search.

    As PopTorch: ``probs`` are log-probabilities [input_length, batch, classes] and
    ``lengths`` [batch] the valid time steps of each sequence. Returns the paths'
    log-probabilities [batch, top_paths], their lengths [batch, top_paths] (int32) and
    the paths [batch, top_paths, input_length] (int32, padded with 0). Decoding runs
    on the current values every time the program runs (``ipuxl.kernels.ctc_decoder``);
    it has no gradient.
    """
    _check_tensor(probs, "ctc_beam_search_decoder: probs must be a torch.tensor argument.")
    _check_tensor(lengths, "ctc_beam_search_decoder: lengths must be a torch.tensor argument.")
    if probs.dim() != 3 or not probs.is_floating_point():
        raise _bad(f"ctc_beam_search_decoder: probs must be a float tensor [input_length, batch_size, num_classes], "
                   f"got {_spec(probs)}", "pass log-probabilities of that shape")
    if tuple(lengths.shape) != (probs.shape[1],) or lengths.is_floating_point():
        raise _bad(f"ctc_beam_search_decoder: lengths must be an integer tensor [batch_size] = [{probs.shape[1]}], "
                   f"got {_spec(lengths)}", "pass one length per sequence of the batch")
    checks = [(blank, 0, probs.shape[2] - 1, "blank"), (beam_width, 1, None, "beam_width"),
              (top_paths, 1, beam_width, "top_paths")]
    for value, low, high, name in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            raise _bad(f"ctc_beam_search_decoder: {name} must be an int in [{low}, {high if high is not None else ''}"
                       f"], got {value!r}", f"pass a valid {name}")
    return list(torch.ops.ipuxl.ctc_beam_search_decoder(probs, lengths, blank, beam_width, top_paths))


# -- point clouds (torch_cluster's ops) ------------------------------------------------------------
def fps(src: torch.Tensor, ptr: list[int], ratio: float = 0.5, random_start: bool = False) -> torch.Tensor:
    """Farthest point sampling of each sample ``src[ptr[i]:ptr[i+1]]`` (torch_cluster's ``fps``).

    Each sample keeps ``ceil(ratio * size)`` points: its first point, then repeatedly
    the point farthest from those kept. Returns their indices into ``src`` (int64).
    ``random_start=True`` is refused: a start drawn once while tracing would not be
    fresh per run.
    """
    _check_tensor(src, "`fps` must take a torch.tensor input.")
    if not isinstance(ptr, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in ptr):
        raise _bad("`ptr` must be a list of integers.", "pass the sample boundaries, e.g. [0, 10, 25]")
    if not len(ptr) >= 2:
        raise _bad("`ptr` must containt at least 2 elements.", "pass at least [0, number of points]")
    if ptr[0] < 0 or ptr[-1] > src.shape[0] or any(a > b for a, b in zip(ptr, ptr[1:])):
        raise _bad(f"fps: `ptr` {ptr} must rise from 0 to at most {src.shape[0]} (the points of src)",
                   "pass sorted boundaries within src")
    if not isinstance(ratio, float):
        raise _bad(f"`ratio` must be of float type. {type(ratio)} is not supported.", "pass e.g. 0.5")
    if not isinstance(random_start, bool):
        raise _bad(f"`random_start` must be of bool type. {type(random_start)} is not supported.", "pass a bool")
    if random_start:
        raise OpContextError("fps: random_start=True is not supported by ipuxl (the start would be drawn once, "
                             "while tracing)", where=user_source_line(),
                             fix="use random_start=False, shuffling the points of each sample on the host if needed")
    return torch.ops.ipuxl.fps(src, list(ptr), ratio, [0] * (len(ptr) - 1))


def nearest(x: torch.Tensor, y: torch.Tensor, batch_x: list[int] | torch.Tensor | None = None,
            batch_y: list[int] | torch.Tensor | None = None) -> torch.Tensor:
    """For each point of ``x``, the index of the nearest point of ``y`` in the same sample
    (torch_cluster's ``nearest``; Euclidean distance, the first on ties).

    ``batch_x``/``batch_y`` give each point's sample (sorted), as tensors or lists;
    None or empty: one sample. Returns int64 indices into ``y``.
    """
    _check_tensor(x, "`nearest` must take a torch.tensor `x` input.")
    _check_tensor(y, "`nearest` must take a torch.tensor `y` input.")
    groups = []
    for name, batch, points in (("batch_x", batch_x, x), ("batch_y", batch_y, y)):
        if batch is None or (isinstance(batch, list) and not batch):
            batch = torch.zeros(points.shape[0], dtype=torch.long, device=points.device)
        elif isinstance(batch, list):
            batch = torch.tensor(batch, dtype=torch.long, device=points.device)
        elif not isinstance(batch, torch.Tensor):
            raise _bad(f"`batch_x` and `batch_y` must be torch.Tensors or lists while `{name}` is of type "
                       f"{type(batch)}.", "pass a tensor or a list of sample indices")
        if tuple(batch.shape) != (points.shape[0],):
            raise _bad(f"nearest: `{name}` must have one entry per point ({points.shape[0]}), got "
                       f"{tuple(batch.shape)}", "give each point its sample index")
        groups.append(batch)
    distance = torch.cdist(x.reshape(x.shape[0], -1).double(), y.reshape(y.shape[0], -1).double())
    other = groups[0].reshape(-1, 1) != groups[1].reshape(1, -1)
    return torch.where(other, torch.inf, distance).argmin(1)


# -- debugging and identity ops ----------------------------------------------------------------
def ipu_print_tensor(tensor: torch.Tensor, title: str = "", print_gradient: bool = True,
                     summarise_threshold: int = 1000, edge_items: int = 3, max_line_width: int = 80,
                     digits: int = 4, float_format: str = "auto", separator: str = ", ",
                     open_bracket: str = "(", close_bracket: str = ")") -> torch.Tensor:
    """Print ``tensor`` to stderr every time the program runs, in Poplar's layout; returns a copy.

    As PopTorch: use the returned tensor (an unused print may be removed); in training
    the gradient reaching it is printed too, titled ``"<title>_gradient"``, when
    ``print_gradient``. ``summarise_threshold`` (0: never) shows only ``edge_items`` per
    dimension of larger tensors; ``max_line_width`` (0: never) wraps rows; ``digits``
    (0: unaligned) sets the precision; ``float_format`` is ``"auto"``, ``"fixed"``,
    ``"scientific"`` or ``"none"``.
    """
    _check_tensor(tensor, "ipu print tensor must take a torch.tensor argument.")
    if float_format not in FLOAT_FORMATS:
        raise _bad(f"ipu_print_tensor: float_format must be one of {FLOAT_FORMATS}, got {float_format!r}",
                   "pass one of those strings")
    ints = dict(summarise_threshold=summarise_threshold, edge_items=edge_items, max_line_width=max_line_width,
                digits=digits)
    for name, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _bad(f"ipu_print_tensor: {name} must be an int >= 0, got {value!r}", f"pass {name} as an int")
    return torch.ops.ipuxl.ipu_print_tensor(tensor, str(title), bool(print_gradient), summarise_threshold,
                                            edge_items, max_line_width, digits, float_format, str(separator),
                                            str(open_bracket), str(close_bracket))


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """An identity that the graph keeps (PopTorch's debugging no-op): a copy of ``tensor``."""
    _check_tensor(tensor, "nop must take a torch.tensor argument.")
    return tensor.clone()


def recomputationCheckpoint(*tensors: Any) -> Any:
    """Mark tensors to keep between forward and backward; returns them (one tensor, or a tuple,
    or a list/tuple of the type passed).

    No effect on a simulated device: ipuxl keeps every activation the backward reads.
    """
    if len(tensors) == 1 and isinstance(tensors[0], (tuple, list)):
        return type(tensors[0])(recomputationCheckpoint(*tensors[0]))
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise _bad(f"All inputs must be tensors (got {type(t).__name__})", "pass only tensors")
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor, mode: MatMulSerializationMode, factor: int = 0,
                     keep_precision: bool = False) -> torch.Tensor:
    """``torch.matmul(lhs, rhs)``, which PopTorch splits into ``factor`` serial matmuls along ``mode``.

    The arguments are checked as PopTorch (and PopART) check them: ``factor`` must
    divide the serialised dimension. The serialisation itself has no effect on a
    simulated device (the product is the same).
    """
    if not isinstance(keep_precision, bool):
        raise _bad(f"serializedMatMul: keep_precision must be a bool, got {keep_precision!r}", "pass True or False")
    if isinstance(factor, bool) or not isinstance(factor, int):
        raise _bad(f"serializedMatMul: factor must be an int, got {factor!r}", "pass factor as an int")
    if not isinstance(mode, MatMulSerializationMode):
        raise _bad(f"serializedMatMul: mode must be a poptorch.MatMulSerializationMode, got {mode!r}",
                   "pass e.g. poptorch.MatMulSerializationMode.OutputChannels")
    out = torch.matmul(lhs, rhs)
    if mode is not MatMulSerializationMode.Disabled:
        _check_factor(lhs, rhs, mode, factor)
    return out


def _check_factor(lhs: torch.Tensor, rhs: torch.Tensor, mode: MatMulSerializationMode, factor: int) -> None:
    dims = {MatMulSerializationMode.InputChannels: ("input channels (lhs dim -2)", lhs.shape[-2] if lhs.dim() > 1
                                                    else 1),
            MatMulSerializationMode.ReducingDim: ("reducing dimension (lhs dim -1)", lhs.shape[-1]),
            MatMulSerializationMode.OutputChannels: ("output channels (rhs dim -1)", rhs.shape[-1])}
    name, length = dims[mode]
    if factor < 1 or length % factor:
        raise _bad(f"serializedMatMul: factor {factor} must be >= 1 and divide the {name} of length {length}",
                   f"pass a factor of {length}, or MatMulSerializationMode.Disabled")


def set_available_memory(tensor: torch.Tensor, available_memory_proportion: float) -> torch.Tensor:
    """Set the temporary memory proportion (0 to 1) Poplar plans the op making ``tensor`` with;
    returns ``tensor``. No effect on a simulated device (it only steers Poplar's planner)."""
    _check_tensor(tensor, "You may only set available memory for torch.tensor values.")
    value = available_memory_proportion
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise _bad(f"set_available_memory: available_memory_proportion must be a number in [0, 1], got {value!r}",
                   "pass a proportion such as 0.6 (PopTorch's default)")
    return tensor


def _set_overlap(tensors: Any, mode: OverlapMode, side: str) -> Any:
    if not isinstance(mode, OverlapMode):
        raise _bad(f"set_overlap_for_{side}: mode must be a poptorch.OverlapMode, got {mode!r}",
                   "pass e.g. poptorch.OverlapMode.OverlapAccumulationLoop")
    leaves, spec = pytree.tree_flatten(tensors)
    for leaf in leaves:
        _check_tensor(leaf, f"You may only set overlap for torch.tensor {side}s.")
    return pytree.tree_unflatten(leaves, spec)


def set_overlap_for_input(input_tensors: Any, mode: OverlapMode) -> Any:
    """Let host input transfers of ``input_tensors`` (a tensor, or tuples/lists/dicts of them)
    overlap compute; returns them. No effect on a simulated device (no IO tiles)."""
    return _set_overlap(input_tensors, mode, "input")


def set_overlap_for_output(output_tensors: Any, mode: OverlapMode) -> Any:
    """Let host output transfers of ``output_tensors`` overlap compute; returns them. No effect
    on a simulated device (no IO tiles)."""
    return _set_overlap(output_tensors, mode, "output")


# -- scopes --------------------------------------------------------------------------------------
class MultiConv:
    """Combine the convolutions run inside ``with MultiConv():`` into one multi-convolution.

    The setters check and record their values as PopTorch does and return ``self``;
    the combination has no effect on a simulated device (each convolution runs as in
    eager PyTorch, with the same result).
    """

    def __init__(self) -> None:
        self._available_memory_proportions: Sequence[float] | None = None
        self._partials_types: Sequence[int] | None = None
        self._plan_type: MultiConvPlanType | None = None
        self._per_conv_reserved_tiles: int | None = None
        self._cycle_back_off: float | None = None
        self._enable_conv_ditherings: Sequence[bool] | None = None

    @staticmethod
    def _per_conv(name: str, value: Any, kind: type) -> Any:
        if value is None:
            return None
        if isinstance(value, kind):
            return (value,)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, kind) for v in value):
            return value
        raise _bad(f"Invalid {name}! Expected a {kind.__name__} or a non-empty list/tuple of them, got {value!r}",
                   f"pass one {kind.__name__} for all convolutions, or one per convolution")

    def availableMemoryProportions(self, value: float | list[float]) -> MultiConv:
        """The available memory proportion of each convolution (one float for all)."""
        self._available_memory_proportions = self._per_conv("available memory proportion", value, float)
        return self

    def partialsTypes(self, value: torch.dtype | list[torch.dtype]) -> MultiConv:
        """The partials type (``torch.float`` or ``torch.half``) of each convolution."""
        def encode(dtype: Any) -> int:
            if dtype in (torch.float, torch.float32):
                return 0
            if dtype in (torch.half, torch.float16):
                return 1
            raise _bad(f"Invalid partials types. Expecting torch.float or torch.half, got {dtype!r}",
                       "pass torch.float or torch.half")
        self._partials_types = [encode(v) for v in value] if isinstance(value, (list, tuple)) else (encode(value),)
        return self

    def enableConvDithering(self, value: bool | list[bool]) -> MultiConv:
        """Enable dithering per convolution (one bool for all)."""
        if value is not None and not (isinstance(value, bool) or (isinstance(value, (list, tuple))
                                                                   and all(isinstance(v, bool) for v in value))):
            raise _bad(f"value must be bool or list of bools, got {value!r}", "pass True/False or a list of them")
        self._enable_conv_ditherings = (value,) if isinstance(value, bool) else value
        return self

    def planType(self, value: MultiConvPlanType | None) -> MultiConv:
        """The multi-convolution plan (``poptorch.MultiConvPlanType``)."""
        if value is not None and not isinstance(value, MultiConvPlanType):
            raise _bad(f"Invalid plan type! Expected a poptorch.MultiConvPlanType, got {value!r}",
                       "pass poptorch.MultiConvPlanType.Parallel or .Serial")
        self._plan_type = value
        return self

    def perConvReservedTiles(self, value: int) -> MultiConv:
        """Tiles to reserve for each convolution."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(f"perConvReservedTiles: value must be an int, got {value!r}", "pass a number of tiles")
        self._per_conv_reserved_tiles = value
        return self

    def cycleBackOff(self, value: float) -> MultiConv:
        """The cycle back-off proportion (a float between 0 and 1)."""
        if not isinstance(value, float):
            raise _bad(f"cycleBackOff: value must be a float, got {value!r}", "pass a float such as 0.1")
        self._cycle_back_off = value
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class NameScope:
    """Prefix the names of the ops made inside ``with NameScope(name):``. No effect on a simulated
    device (ipuxl's op names come from the traced graph)."""

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise _bad(f"Parameter to NameScope must be a string, got {type(name).__name__}", "pass a str")
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# -- host callbacks -------------------------------------------------------------------------------
class CPU:
    """Run ``layer_to_call`` on the host in the middle of the device program (PopTorch's CPU op).

    Calling the wrapper inside a model's forward records one host callback: each time
    the program runs, the device passes the current input values to ``layer_to_call``
    and continues with its outputs, which must keep the shapes and dtypes they had
    when the model was traced (PopTorch traces by calling it on zeros; so does ipuxl).
    Outside a traced model the wrapper simply calls ``layer_to_call``. As in PopTorch,
    CPU ops are for inference: no gradient flows through them (a module's parameters
    are set not to require grad), and a training model whose trained parameters feed
    one raises. Keep the wrapper alive while the model runs.
    """

    def __init__(self, layer_to_call: Callable[..., Any], ID: str):
        self._layer_to_call = layer_to_call
        if isinstance(layer_to_call, torch.nn.Module):
            layer_to_call.requires_grad_(False)
        self._ID = ID
        self.in_shapes: list[torch.Size] | None = None
        self.out_shapes: list[torch.Size] | None = None
        self._callbacks: dict[tuple, tuple[host_callbacks.Callback, int]] = {}
        self._single: dict[tuple, bool] = {}  # per input specs: the layer returned one tensor

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        if active_mode() is None:
            return self._layer_to_call(*input)
        for t in input:
            _check_tensor(t, f"CPU op '{self._ID}' takes tensors only;")
        if _differentiated(input):
            raise OpContextError(f"CPU op '{self._ID}': CPU ops are only supported in inference graphs (its "
                                 "inputs depend on trained parameters here)", where=user_source_line(),
                                 fix="use the CPU op in an inferenceModel, or only on values that need no "
                                     "gradient (inputs, or tensors under torch.no_grad())")
        key = tuple((tuple(t.shape), t.dtype) for t in input)
        if key not in self._callbacks:
            self._callbacks[key] = self._register(key)
        callback, handle = self._callbacks[key]
        self.in_shapes = [t.shape for t in input]
        self.out_shapes = [torch.Size(shape) for shape, _ in callback.outputs]
        outputs = torch.ops.ipuxl.host_callback([t.detach() for t in input], handle)
        return outputs[0] if self._single[key] else list(outputs)

    def _register(self, key: tuple) -> tuple[host_callbacks.Callback, int]:
        """Call the layer on zeros (in a thread of its own, outside the trace) to learn its outputs."""
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                with torch.no_grad():
                    result["out"] = self._layer_to_call(*[torch.zeros(s, dtype=d) for s, d in key])
            except Exception as exc:  # re-raised in the tracing thread, with its type
                result["error"] = exc

        worker = threading.Thread(target=run, name=f"poptorch.CPU {self._ID}")
        worker.start()
        worker.join()
        if "error" in result:
            raise result["error"]
        outs = result["out"]
        self._single[key] = not isinstance(outs, (list, tuple))
        outs = _as_list(outs)
        for o in outs:
            _check_tensor(o, f"CPU op '{self._ID}' must return tensors;")
        callback = host_callbacks.Callback(self._layer_to_call, str(self._ID),
                                           [(tuple(o.shape), o.dtype) for o in outs])
        return callback, host_callbacks.register(callback)


# -- custom ops -----------------------------------------------------------------------------------
_custom_ops: dict[tuple[str, str, int], Callable[..., Any]] = {}


def register_custom_op(name: str, domain: str, domain_version: int, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as the implementation of ``poptorch.custom_op(..., name, domain, domain_version, ...)``.

    An ipuxl extension: PopTorch's custom ops are C++ PopART ops, which cannot run
    here; ``fn(*inputs, **attributes)`` is torch code returning the op's outputs (a
    tensor or a tuple of them), traced into the program and differentiated by
    autograd like the rest of the model. Registering the same key again replaces it.
    """
    if not callable(fn):
        raise _bad(f"register_custom_op: fn must be callable, got {type(fn).__name__}", "pass a function")
    _custom_ops[(str(domain), str(name), int(domain_version))] = fn


def custom_op(inputs: Sequence[torch.Tensor], name: str, domain: str, domain_version: int,
              example_outputs: Sequence[torch.Tensor],
              attributes: dict[str, float | int | str | list | tuple] | None = None) -> Tensors:
    """Apply the custom op ``domain::name`` (version ``domain_version``) to ``inputs``; returns its outputs.

    ``attributes`` are checked as PopTorch checks them and passed to the implementation
    as keyword arguments; the outputs must match ``example_outputs`` in number, shape
    and dtype. Implementations are Python functions registered with
    ``register_custom_op`` (C++ PopART custom ops cannot run on ipuxl).

    Raises:
        OpArgumentError: bad attributes, or outputs that do not match ``example_outputs``.
        OpContextError: no Python implementation is registered for the op.
    """
    _check_attributes(attributes)
    fn = _custom_ops.get((str(domain), str(name), int(domain_version)))
    if fn is None:
        raise OpContextError(
            f"custom op '{domain}::{name}' (version {domain_version}) has no Python implementation; PopART (C++) "
            "custom ops cannot run on ipuxl's simulated IPU", where=user_source_line(),
            fix=f"register one: ipuxl.poptorch_compat.ops.register_custom_op({name!r}, {domain!r}, "
                f"{domain_version}, fn) with fn(*inputs, **attributes) written in torch")
    outputs = _as_list(fn(*inputs, **(attributes or {})))
    expected, got = [_spec(t) for t in example_outputs], [_spec(t) for t in outputs]
    if expected != got:
        raise _bad(f"custom op '{domain}::{name}' returned {got}, but example_outputs promise {expected}",
                   "make the implementation return tensors of the example outputs' shapes and dtypes")
    return outputs


def _check_attributes(attributes: dict[str, Any] | None) -> None:
    """PopTorch's checks: string keys, and values that are floats, ints, ASCII strings, or
    non-mixed lists/tuples of them."""
    fix = "use str keys and float/int/str values (or lists/tuples of one of those types), ASCII only"
    for key, value in (attributes or {}).items():
        if not isinstance(key, str):
            raise _bad("All attribute keys must be strings.", fix)
        if not isinstance(value, (float, int, str, list, tuple)):
            raise _bad("Attribute values must be floats, ints, strings or a list/tuple of float, ints of strings.",
                       fix)
        if isinstance(value, (list, tuple)) and any(not isinstance(v, type(value[0])) for v in value):
            raise _bad("The types in a list/tuple attribute must all be the same.", fix)
        for text in [key, *(value if isinstance(value, (list, tuple)) else [value])]:
            if isinstance(text, str) and not text.isascii():
                raise _bad(f"{text} contains non-ASCII characters.", fix)
