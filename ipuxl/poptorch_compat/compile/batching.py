"""How a wrapped model's combined batch maps to the program's streams, and back.

The combined batch's first dimension is laid out as PopTorch/PopART lay out host
data: ``[deviceIterations, gradientAccumulation, replicas, micro-batch, ...]``
(iterations outermost). ``split_batch`` checks that every tensor argument splits so
and reorders it for the input streams, which take ``(iterations, replicas,
accumulation x micro-batch, ...)``: one replica's micro-batches of a step are
consecutive in its stream. A scalar (0-d) argument counts as one sample, as
upstream: it is fed as it is when the split factor is 1 and refused otherwise.
Under torchrun (``WORLD_SIZE`` = P > 1) each process
feeds, and gets back, only its own R / P replicas, as each PopTorch process does
with PopRun.

``Options.inputReplicaGrouping(k, type)`` makes the replicas of one group of k share
one input slice, as upstream: the combined batch then holds R / k slices per step
(``[deviceIterations, gradientAccumulation, R / k, micro-batch]``) and slice g goes
to every replica of group g (``replica_groups``: ``Consecutive`` groups
``{0..k-1}, {k..2k-1}...``, ``Orthogonal`` groups ``{g, g + R/k, ...}``). Outputs
still come back from every replica; an input written in place is read back from the
first replica of each group.

Outputs come back in the same order, per output mode (``reduce_outputs``: PopTorch's
shapes): All/EveryN concatenate every returned micro-batch of every replica;
Final/Sum give one result per replica.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from ipuxl.device.host_data import host_tensors
from ipuxl.errors import BatchSizeError, OptionsError, UnsupportedError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.world import world
from ipuxl.poptorch_compat.custom_args import register_subclasses
from ipuxl.poptorch_compat.enums import CommGroupType
from ipuxl.poptorch_compat.options import Options, OutputMode
from ipuxl.poptorch_compat.compile.program import Program

__all__ = ["local_replica_range", "MicroBatch", "SplitBatch", "split_batch", "example_call", "describe", "replicas_here", "gather_outputs",
           "update_inputs", "reduce_outputs", "replica_groups"]

# a device run's results: the data of every device-to-host stream
Results = dict[Any, torch.Tensor]
"""A run's stored outputs per stream, where the device keeps them (``Session.run_on_device``)."""


class MicroBatch(tuple):
    """Shape and dtype of one input's micro-batch (hashable, for the compile key)."""

    def __new__(cls, shape: tuple, dtype: torch.dtype) -> "MicroBatch":
        return super().__new__(cls, (tuple(shape), dtype))

    @property
    def shape(self) -> tuple:
        return self[0]

    @property
    def dtype(self) -> torch.dtype:
        return self[1]


class SplitBatch(NamedTuple):
    """One call's combined batch, split (see ``split_batch``).

    Attributes:
        micro: the compile key: ``(leaves, spec)`` of the call with each tensor replaced
            by its ``MicroBatch`` (other leaves are kept: they are part of the program).
        stacked: each tensor argument's data laid out for its input stream.
        tensors: the call's tensor arguments (the caller's own tensors).
    """

    micro: tuple
    stacked: list[torch.Tensor]
    tensors: list[torch.Tensor]


def _kind(training: bool) -> str:
    return "training" if training else "inference"


def replicas_here(options: Options) -> int:
    """The replicas this process feeds (all of them unless under torchrun).

    Raises:
        OptionsError: ``Options.Distributed`` names another process than this one.
    """
    distributed = options.Distributed
    processes, rank = world()
    if distributed.configured and (distributed.numProcesses, distributed.processId) != (processes, rank):
        raise OptionsError(
            f"Options.Distributed.configureProcessId({distributed.processId}, {distributed.numProcesses}) "
            f"does not match this run: process {rank} of {processes}", where=user_source_line(),
            fix="launch the processes with torchrun (it sets RANK and WORLD_SIZE, which the options read "
                "by default), or leave configureProcessId out")
    return options.replicas_per_process()


def local_replica_range(options: Options) -> tuple[int, int]:
    """[first, last) global indices of the replicas this process runs (all of them unless under torchrun)."""
    replicas = replicas_here(options)
    rank = world()[1]
    return rank * replicas, (rank + 1) * replicas


def replica_groups(options: Options) -> list[int]:
    """The input group of each replica this process runs (``Options.inputReplicaGrouping``):
    replicas of one group are fed the same slice of the combined batch.

    Raises:
        OptionsError: the group size does not divide the replication factor, or
            ``NoGrouping`` is given a group size other than 1.
        UnsupportedError: groups of more than one replica under torchrun.
    """
    replicas, size, kind = options.total_replicas(), options.input_group_size, options.input_group_type
    if size == 1:
        return list(range(*local_replica_range(options)))
    setting = f"Options.inputReplicaGrouping({size}, CommGroupType.{kind.name})"
    if kind == CommGroupType.NoGrouping or replicas % size:
        raise OptionsError(
            f"{setting} does not fit replicationFactor({replicas}): "
            + ("NoGrouping puts each replica in its own group" if kind == CommGroupType.NoGrouping
               else f"{size} does not divide {replicas}"), where=user_source_line(),
            fix="use a group size that divides the replication factor (with CommGroupType.Consecutive or "
                "Orthogonal), or inputReplicaGrouping(1, CommGroupType.NoGrouping)")
    if options.Distributed.numProcesses > 1:
        raise UnsupportedError(
            f"{setting} with {options.Distributed.numProcesses} processes",
            where=user_source_line(), fix="run the replicas in one process, or leave inputReplicaGrouping out")
    count = replicas // size
    return [r // size if kind == CommGroupType.Consecutive else r % count for r in range(replicas)]


def split_batch(options: Options, training: bool, args: tuple, kwargs: dict) -> SplitBatch:
    """Validate the combined batch of a call and split it (see the module docstring).

    Raises:
        BatchSizeError: a tensor argument's first dimension does not split into
            micro-batches for every iteration, accumulation step and replica.
    """
    replicas = replicas_here(options)
    accumulation = options.gradient_accumulation if training else 1
    if not training:
        options.combined_batch_factor(False)  # refuses gradient accumulation for inference
    n = options.device_iterations
    groups = replica_groups(options)
    slices = len(set(groups))
    factor = n * accumulation * slices
    register_subclasses((args, kwargs))  # custom argument types (ICustomArgParser) open like tuples
    leaves, spec = pytree.tree_flatten((args, kwargs))
    micro_leaves: list[Any] = []
    stacked, tensors = [], []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            micro_leaves.append(leaf)
            continue
        if leaf.dim() == 0:  # a scalar: as upstream, one "sample", fed as it is when nothing splits
            if factor != 1:
                raise _batch_size_error(options, training, leaf, factor, replicas)
            micro_leaves.append(MicroBatch((), leaf.dtype))
            stacked.append(leaf.detach())
            tensors.append(leaf)
            continue
        if leaf.shape[0] % factor:
            raise _batch_size_error(options, training, leaf, factor, replicas)
        micro = leaf.shape[0] // factor
        rest = tuple(leaf.shape[1:])
        micro_leaves.append(MicroBatch((micro, *rest), leaf.dtype))
        stacked.append(_stream_data(leaf.detach(), n, accumulation, groups, micro))
        tensors.append(leaf)
    return SplitBatch((tuple(micro_leaves), spec), stacked, tensors)


def _stream_data(data: torch.Tensor, n: int, accumulation: int, groups: list[int], micro: int) -> torch.Tensor:
    """One input's combined batch ``[n, G, slices, m, ...]`` as its stream takes it:
    ``(n, R, G x m, ...)`` (dims of 1 dropped), replica r getting slice ``groups[r]``."""
    replicas, slices, rest = len(groups), len(set(groups)), tuple(data.shape[1:])
    if slices != replicas or (replicas > 1 and accumulation > 1):  # [n, G, S, m] -> [n, S, G, m]
        data = data.reshape(n, accumulation, slices, micro, *rest).transpose(1, 2)
        if slices != replicas:  # each replica takes its group's slice
            data = data[:, groups]
    host_shape = tuple(d for d in (n, replicas) if d > 1) + (accumulation * micro, *rest)
    return data.reshape(host_shape)


def _batch_size_error(options: Options, training: bool, leaf: torch.Tensor, factor: int,
                      replicas: int) -> BatchSizeError:
    where = user_source_line()
    parts = f"{_factors(options, training, replicas)} = {factor} parts"
    if leaf.dim() == 0:  # upstream counts a scalar as a batch of 1
        return BatchSizeError(
            f"{_kind(training)} model input is a scalar (shape ()): it has no batch dimension to split into "
            f"{parts}", where=where,
            fix=f"give it a batch dimension of {factor} (e.g. x.expand({factor}) for the same value in every "
                "micro-batch), or set deviceIterations, gradientAccumulation and replicationFactor to 1")
    size = leaf.shape[0]
    lower, upper = (size // factor) * factor, (size // factor + 1) * factor
    return BatchSizeError(
        f"{_kind(training)} model input of shape {tuple(leaf.shape)}: batch {size} does not split into {parts}",
        where=where,
        fix=f"use a batch that is a multiple of {factor}"
            + (f" (nearest: {lower} or {upper})" if lower else f" (e.g. {upper})")
            + ", e.g. with ipuxl.DataLoader(options, ...), which combines batches for you")


def _factors(options: Options, training: bool, replicas: int) -> str:
    parts = [f"deviceIterations {options.device_iterations}"]
    if training:
        parts.append(f"gradientAccumulation {options.gradient_accumulation}")
    processes = options.Distributed.numProcesses
    if options.input_group_size > 1:
        parts.append(f"(replicationFactor {options.replication_factor} / inputReplicaGrouping size "
                     f"{options.input_group_size})")
    elif processes > 1:
        parts.append(f"replicationFactor {options.replication_factor} (the replicas of this process, of "
                     f"{options.total_replicas()} over {processes} processes)")
    else:
        parts.append(f"replicationFactor {options.replication_factor}")
    return "micro-batch x " + " x ".join(parts)


def example_call(micro: tuple) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of one micro-batch's call, with empty tensors of its shapes (to trace)."""
    leaves, spec = micro
    examples = [torch.empty(v.shape, dtype=v.dtype) if isinstance(v, MicroBatch) else v for v in leaves]
    args, kwargs = pytree.tree_unflatten(examples, spec)
    return args, kwargs


def describe(key: tuple | None) -> str:
    """A compile key for messages: ``[4, 3] float32, True``."""
    if key is None:
        return "(none)"
    return ", ".join(f"{list(v.shape)} {str(v.dtype).replace('torch.', '')}" if isinstance(v, MicroBatch)
                     else repr(v) for v in key[0])


def _per_micro_batch(options: Options, results: Results, streams: list[Any],
                     iterations: slice = slice(None)) -> torch.Tensor:
    """One output's results of this process's replicas: ``(n, G, local replicas, *shape)``
    (of the device ``iterations`` only), where the device keeps them."""
    n, replicas = options.device_iterations, options.total_replicas()
    first, last = local_replica_range(options)
    views = [results[s].reshape(n, replicas, *s.shape)[iterations, first:last] for s in streams]
    return views[0].unsqueeze(1) if len(views) == 1 else torch.stack(views, 1)


def gather_outputs(options: Options, training: bool, program: Program, results: Results) -> Any:
    """The call's outputs per output mode, on the host; under torchrun, those of this
    process's replicas. With ``OutputMode.Final`` only the last micro-batch's leave the device."""
    mode = options.resolved_output_mode(training)
    per_output = []
    for streams in program.outputs:
        if mode is OutputMode.Final:
            streams, seq = streams[-1:], _per_micro_batch(options, results, streams[-1:], slice(-1, None))
        else:
            seq = _per_micro_batch(options, results, streams)
        per_output.append(seq.reshape(seq.shape[0] * seq.shape[1], seq.shape[2], *streams[0].shape))
    flat = [device_dtype(t) for t in host_tensors(reduce_outputs(per_output, mode, options.output_return_period))]
    outputs = pytree.tree_unflatten(flat, program.traced.out_spec)
    return None if isinstance(outputs, tuple) and not outputs else outputs  # no outputs: None, as PopTorch


def device_dtype(output: torch.Tensor) -> torch.Tensor:
    """``output`` as PopTorch returns it: the IPU has no 64-bit integers, so an int64
    result comes back int32 (as upstream, e.g. ``torch.sum`` of a bool tensor)."""
    return output.to(torch.int32) if output.dtype == torch.int64 else output


def update_inputs(options: Options, program: Program, results: Results, tensors: list[torch.Tensor]) -> None:
    """Write the new values of inputs that ``forward`` changed in place into the caller's
    tensors, every micro-batch in its place of the combined batch (as eager ``forward``
    on each micro-batch's slice would)."""
    groups = replica_groups(options)
    first = [groups.index(g) for g in sorted(set(groups))]  # one replica per input group
    for index, streams in program.input_updates:
        target = tensors[index]
        with torch.no_grad():
            target.copy_(_per_micro_batch(options, results, streams)[:, :, first].reshape(target.shape))


def reduce_outputs(per_step: list[torch.Tensor], mode: OutputMode, period: int) -> list[torch.Tensor]:
    """Apply an output mode to each output's per-micro-batch results.

    Each entry is shaped ``(steps, R, *shape)``: ``steps`` = deviceIterations x
    gradientAccumulation micro-batches in order, R replicas each. As upstream
    (PopART's anchor shapes ``[batches, accumulation, replicas, *shape]`` flattened
    into the first dim):

    * All: every micro-batch of every replica, concatenated along the first
      dimension in the input order (iterations, then accumulation, then replicas);
      scalars become a ``(steps * R,)`` vector;
    * EveryN: micro-batches N-1, 2N-1, ... of each replica, concatenated as in All;
    * Final: the last micro-batch; Sum: the element-wise sum over the micro-batches,
      in the output's dtype (a bool output: whether any micro-batch's was True).
      With R > 1 replicas, one result per replica concatenated along the first
      dimension (a scalar becomes an ``(R,)`` vector).

    When one result is returned (a single micro-batch and replica, or Final/Sum
    with one replica) the output keeps its own shape: a scalar stays 0-d, as
    upstream, which adds the batch dimension only when it is larger than 1.
    """
    return [_reduce_output(seq, mode, period) for seq in per_step]


def _reduce_output(seq: torch.Tensor, mode: OutputMode, period: int) -> torch.Tensor:
    replicas = seq.shape[1]
    if mode == OutputMode.EveryN:
        seq = seq[period - 1::period]
    if mode in (OutputMode.All, OutputMode.EveryN):
        return _flatten_batch(seq.reshape(seq.shape[0] * replicas, *seq.shape[2:]))
    if mode == OutputMode.Final:
        per_replica = seq[-1]
    elif mode == OutputMode.Sum:
        per_replica = seq.any(0) if seq.dtype == torch.bool else seq.sum(0, dtype=seq.dtype)
    else:
        raise ValueError(f"unresolved output mode {mode}")
    return _flatten_batch(per_replica)


def _flatten_batch(seq: torch.Tensor) -> torch.Tensor:
    """``(k, *shape)`` results -> concatenated along the first dim (scalars: a (k,) vector);
    a single result (k = 1) keeps its own shape."""
    if seq.shape[0] == 1:
        return seq[0]
    return seq if seq.dim() == 1 else seq.reshape(seq.shape[0] * seq.shape[1], *seq.shape[2:])
