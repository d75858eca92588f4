"""PopTorch's tensor ops: ``dynamic_slice``, ``dynamic_update``, ``ctc_beam_search_decoder``,
and torch_cluster's ``fps`` and ``nearest``.

Each takes upstream's arguments and checks; the decoder and ``fps`` are torch custom ops
(``ipuxl.kernels``) that run on the current values every time the program runs.
"""
from __future__ import annotations

from typing import Any

import torch

from ipuxl.errors import OpContextError
from ipuxl.ir.context import user_source_line
from ipuxl.kernels import cluster, ctc_decoder  # they register torch.ops.ipuxl.fps and .ctc_beam_search_decoder
from ipuxl.poptorch_compat.ops.arguments import Tensors, bad_arg, check_tensor, spec_of

__all__ = ["dynamic_slice", "dynamic_update", "ctc_beam_search_decoder", "fps", "nearest"]


# -- slicing --------------------------------------------------------------------------------------------------
def _slice_start(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int, op: str) -> torch.Tensor:
    """The runtime start as a 0-d long tensor clamped so that ``size`` elements fit in ``dim``."""
    if size == 0:
        raise bad_arg(f"{op}: The start and end of a slice must be different.", "slice at least one element")
    if size < 0:
        raise bad_arg(f"{op}: Taking a slice of a tensor with the end less than the start is not supported.",
                      "pass a positive size")
    if size > tensor.shape[dim]:
        raise bad_arg(f"{op}: the slice size ({size}) is larger than dimension {dim} ({tensor.shape[dim]})",
                      "slice at most the whole dimension")
    if start.numel() != 1 or start.is_floating_point():
        raise bad_arg(f"{op}: the start must be an integer tensor with one element, got {spec_of(start)}",
                      "pass e.g. torch.tensor([i])")
    return start.reshape(()).long().clamp(0, tensor.shape[dim] - size)


def _check_dim(tensor: torch.Tensor, dim: Any, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise bad_arg(f"{op}: Dimension must be an integer.", "pass dim as an int")
    if not -tensor.dim() <= dim < tensor.dim():
        raise bad_arg(f"{op}: dimension {dim} is out of range for a tensor of rank {tensor.dim()}",
                      f"pass a dim in [{-tensor.dim()}, {tensor.dim() - 1}]")
    return dim % tensor.dim()


def dynamic_slice(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int, step: int) -> torch.Tensor:
    """``tensor[start:start+size:step]`` along ``dim``, ``start`` a tensor read at run time.

    As PopTorch, ``size`` and ``step`` are ints and ``size`` must divide the length of
    ``dim``. A start that would run past the end is clamped to ``length - size``.
    """
    op = "dynamic_slice"
    check_tensor(tensor, "dynamic_slice must take a torch.tensor input.")
    dim = _check_dim(tensor, dim, op)
    check_tensor(start, "Slice start argument to dynamic_slice must be a torch.tensor.")
    if isinstance(size, bool) or not isinstance(size, int):
        raise bad_arg("dynamic_slice: Size must be an integer.", "pass size as an int")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise bad_arg(f"dynamic_slice: Step must be an integer >= 1, got {step!r}.", "pass step as an int >= 1")
    first = _slice_start(tensor, dim, start, size, op)
    if tensor.shape[dim] % size:
        raise bad_arg(f"The size of the slice ({size}) must be a factor of the slicing dimension "
                      f"({tensor.shape[dim]}).", "choose a size that divides the dimension")
    return tensor.index_select(dim, first + torch.arange(0, size, step, device=tensor.device))


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor,
                   size: int) -> torch.Tensor:
    """A copy of ``input`` with ``input[start:start+size] = src`` along ``dim`` (``start`` read at
    run time, clamped so that the slice fits)."""
    op = "dynamic_update"
    check_tensor(input, "dynamic_update must take a torch.tensor input.")
    dim = _check_dim(input, dim, op)
    check_tensor(start, "Slice start argument to dynamic_update must be a torch.tensor.")
    check_tensor(src, "Src argument to dynamic_update must be a torch.tensor.")
    if isinstance(size, bool) or not isinstance(size, int):
        raise bad_arg("dynamic_update: Size must be an integer.", "pass size as an int")
    if input.dim() != src.dim():
        raise bad_arg(f"input and src tensors must have same dimensionality. ({input.dim()}) vs ({src.dim()})",
                      "give src the rank of input")
    if input.dtype != src.dtype:
        raise bad_arg(f"input and src tensor must have same dtype. ({input.dtype} vs {src.dtype})",
                      "cast src to input's dtype")
    first = _slice_start(input, dim, start, size, op)
    if src.shape[dim] != size:
        raise bad_arg(f"dynamic_update: src has {src.shape[dim]} elements along dim {dim}, the slice {size}",
                      "make src's length along dim equal to size")
    return input.index_copy(dim, first + torch.arange(size, device=input.device), src)


# -- decoding -------------------------------------------------------------------------------------------------
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
    check_tensor(probs, "ctc_beam_search_decoder: probs must be a torch.tensor argument.")
    check_tensor(lengths, "ctc_beam_search_decoder: lengths must be a torch.tensor argument.")
    if probs.dim() != 3 or not probs.is_floating_point():
        raise bad_arg(f"ctc_beam_search_decoder: probs must be a float tensor [input_length, batch_size, num_classes], "
                      f"got {spec_of(probs)}", "pass log-probabilities of that shape")
    if tuple(lengths.shape) != (probs.shape[1],) or lengths.is_floating_point():
        raise bad_arg(f"ctc_beam_search_decoder: lengths must be an integer tensor [batch_size] = [{probs.shape[1]}], "
                      f"got {spec_of(lengths)}", "pass one length per sequence of the batch")
    checks = [(blank, 0, probs.shape[2] - 1, "blank"), (beam_width, 1, None, "beam_width"),
              (top_paths, 1, beam_width, "top_paths")]
    for value, low, high, name in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            upper = high if high is not None else ""
            raise bad_arg(f"ctc_beam_search_decoder: {name} must be an int in [{low}, {upper}], got {value!r}",
                          f"pass a valid {name}")
    return list(torch.ops.ipuxl.ctc_beam_search_decoder(probs, lengths, blank, beam_width, top_paths))


# -- point clouds (torch_cluster's ops) -----------------------------------------------------------------------
def fps(src: torch.Tensor, ptr: list[int], ratio: float = 0.5, random_start: bool = False) -> torch.Tensor:
    """Farthest point sampling of each sample ``src[ptr[i]:ptr[i+1]]`` (torch_cluster's ``fps``).

    Each sample keeps ``ceil(ratio * size)`` points: its first point, then repeatedly
    the point farthest from those kept. Returns their indices into ``src`` (int64).
    ``random_start=True`` is refused: a start drawn once while tracing would not be
    fresh per run.
    """
    check_tensor(src, "`fps` must take a torch.tensor input.")
    if not isinstance(ptr, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in ptr):
        raise bad_arg("`ptr` must be a list of integers.", "pass the sample boundaries, e.g. [0, 10, 25]")
    if not len(ptr) >= 2:
        raise bad_arg("`ptr` must containt at least 2 elements.", "pass at least [0, number of points]")
    if ptr[0] < 0 or ptr[-1] > src.shape[0] or any(a > b for a, b in zip(ptr, ptr[1:])):
        raise bad_arg(f"fps: `ptr` {ptr} must rise from 0 to at most {src.shape[0]} (the points of src)",
                      "pass sorted boundaries within src")
    if not isinstance(ratio, float):
        raise bad_arg(f"`ratio` must be of float type. {type(ratio)} is not supported.", "pass e.g. 0.5")
    if not isinstance(random_start, bool):
        raise bad_arg(f"`random_start` must be of bool type. {type(random_start)} is not supported.", "pass a bool")
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
    check_tensor(x, "`nearest` must take a torch.tensor `x` input.")
    check_tensor(y, "`nearest` must take a torch.tensor `y` input.")
    groups = []
    for name, batch, points in (("batch_x", batch_x, x), ("batch_y", batch_y, y)):
        if batch is None or (isinstance(batch, list) and not batch):
            batch = torch.zeros(points.shape[0], dtype=torch.long, device=points.device)
        elif isinstance(batch, list):
            batch = torch.tensor(batch, dtype=torch.long, device=points.device)
        elif not isinstance(batch, torch.Tensor):
            raise bad_arg(f"`batch_x` and `batch_y` must be torch.Tensors or lists while `{name}` is of type "
                          f"{type(batch)}.", "pass a tensor or a list of sample indices")
        if tuple(batch.shape) != (points.shape[0],):
            raise bad_arg(f"nearest: `{name}` must have one entry per point ({points.shape[0]}), got "
                          f"{tuple(batch.shape)}", "give each point its sample index")
        groups.append(batch)
    distance = torch.cdist(x.reshape(x.shape[0], -1).double(), y.reshape(y.shape[0], -1).double())
    other = groups[0].reshape(-1, 1) != groups[1].reshape(1, -1)
    return torch.where(other, torch.inf, distance).argmin(1)
