"""popxl.addons' ``array_munging``: numpy helpers laying out host data for replicas.

Sharding splits one axis into ``n`` equal parts stacked on a new first axis (one
per replica); the ``tensor_parallel_*`` helpers build and read back the
``(num_host_transfers, replication_factor, *data_shape)`` layout of PopXL host streams.
"""
from __future__ import annotations

from typing import Callable, Literal, Sequence

import numpy as np

__all__ = [
    "shard", "unshard_arrays", "unshard", "repeat", "repeat_axis", "split2D", "shard2D", "unshard2D",
    "repeat_shard", "tensor_parallel_input", "tensor_parallel_output", "pad_axis", "squeeze_safe",
    "handle_negative_axis",
]


def handle_negative_axis(x: np.ndarray, axis: int) -> int:
    """``axis`` of ``x`` as a non-negative index.

    Raises:
        IndexError: ``x`` is 0-dimensional or ``axis`` is out of range.
    """
    if x.ndim == 0:
        raise IndexError("Array is 0-dimensional")
    if not -x.ndim <= axis < x.ndim:
        raise IndexError(f"Axis is out of range. Axis: {axis}. Array Rank: {x.ndim}")
    return axis % x.ndim


def shard(x: np.ndarray, n: int, axis: int) -> np.ndarray:
    """Split ``axis`` of ``x`` into ``n`` equal parts stacked on a new first axis.

    Example: ``shard(np.arange(8).reshape(4, 2), 2, 0)`` has shape ``(2, 2, 2)``.
    """
    axis = handle_negative_axis(x, axis)
    return np.stack(np.split(x, n, axis=axis))


def unshard_arrays(xs: list[np.ndarray], axis: int) -> np.ndarray:
    """Concatenate arrays that each have a leading axis of 1 along ``axis`` (not counting
    that axis), and drop the leading axis.

    Raises:
        ValueError: the arrays have different ranks.
    """
    if len({x.ndim for x in xs}) > 1:
        raise ValueError(f"All arrays must be of the same rank. Ranks: {','.join(str(x.ndim) for x in xs)}")
    axis = axis + 1 if axis >= 0 else handle_negative_axis(xs[0], axis)
    return np.concatenate(xs, axis=axis).squeeze(0)


def unshard(x: np.ndarray, axis: int) -> np.ndarray:
    """The inverse of ``shard``: concatenate the shards on the first axis along ``axis``."""
    return unshard_arrays(np.split(x, x.shape[0], axis=0), axis)


def repeat(x: np.ndarray, n: int, axis: int = 0) -> np.ndarray:
    """``n`` copies of ``x`` along a new axis inserted at ``axis``."""
    return np.repeat(np.expand_dims(x, axis), n, axis=axis)


def repeat_axis(x: np.ndarray, n: int, axis: int = 0) -> np.ndarray:
    """``x`` tiled ``n`` times along its existing ``axis`` (``[a, b] -> [a, b, a, b]``)."""
    reps = [1] * x.ndim
    reps[axis] = n
    return np.tile(x, reps)


def split2D(x: np.ndarray, n_1: int, n_2: int, axis_1: int, axis_2: int) -> list[list[np.ndarray]]:  # noqa: N802
    """``x`` split into ``n_1`` parts along ``axis_1``, each split into ``n_2`` along ``axis_2``."""
    return [np.split(part, n_2, axis_2) for part in np.split(x, n_1, axis_1)]


def shard2D(x: np.ndarray, n_1: int, n_2: int, axis_1: int, axis_2: int) -> np.ndarray:  # noqa: N802
    """The ``n_1 * n_2`` shards of ``split2D`` stacked on a new first axis, ``axis_1`` outermost."""
    return np.stack([part for row in split2D(x, n_1, n_2, axis_1, axis_2) for part in row])


def unshard2D(x: np.ndarray, n_1: int, n_2: int, axis_1: int, axis_2: int) -> np.ndarray:  # noqa: N802
    """The inverse of ``shard2D``.

    Raises:
        ValueError: the first axis of ``x`` is not ``n_1 * n_2`` long.
    """
    if x.shape[0] != n_1 * n_2:
        raise ValueError(f"unshard2D: expected {n_1} * {n_2} = {n_1 * n_2} shards on axis 0, got {x.shape[0]}")
    shards = np.split(x, x.shape[0], axis=0)
    rows = [unshard_arrays(shards[i * n_2:(i + 1) * n_2], axis_2) for i in range(n_1)]
    return np.concatenate(rows, axis=axis_1)


def repeat_shard(x: np.ndarray, n_repeats: int, n_shards: int, shard_axis: int,
                 sharded_tensor: Literal["contiguous", "strided"] = "contiguous") -> np.ndarray:
    """``shard(x, n_shards, shard_axis)`` repeated ``n_repeats`` times on the first axis.

    ``"contiguous"``: all shards, then all shards again (``[s0, s1, s0, s1]``);
    ``"strided"``: each shard repeated in place (``[s0, s0, s1, s1]``; upstream's
    reshape gives that only when ``n_repeats == n_shards``).

    Raises:
        ValueError: ``sharded_tensor`` is neither.
    """
    shards = shard(x, n_shards, shard_axis)
    if sharded_tensor == "contiguous":
        return repeat_axis(shards, n_repeats, 0)
    if sharded_tensor == "strided":
        return np.repeat(shards, n_repeats, axis=0)
    raise ValueError(f"sharded_tensor should be either 'contiguous' or 'strided'. Not: {sharded_tensor}")


def _check_tp(tp: int, rf: int) -> None:
    if tp > rf:
        raise ValueError(f"tensor parallel factor `tp` is not less than replication factor `rf`: {tp} > {rf}")
    if rf % tp:
        raise ValueError(f"tensor parallel factor `tp` does not equally divide replication factor `rf`: rf/tp={rf / tp}")


def tensor_parallel_input(input_data: np.ndarray, tp: int, rf: int,
                          repeat_fn: Callable[[np.ndarray, int], np.ndarray] | None = None) -> np.ndarray:
    """Host data ``(n, *data_shape)`` laid out as ``(num_host_transfers, rf, *data_shape)``
    where each group of ``tp`` consecutive replicas gets the same sample.

    ``repeat_fn(copy, i)`` may change the copy the ``i``-th replica of a group gets.
    Axes of size 1 (one host transfer, one replica) are dropped, as PopXL streams expect.

    Raises:
        ValueError: ``tp`` is larger than ``rf`` or does not divide it.
    """
    _check_tp(tp, rf)
    data = np.expand_dims(input_data, axis=1)
    copies = [repeat_fn(data.copy(), i) if repeat_fn else data for i in range(tp)]
    data = np.concatenate(copies, axis=1).reshape(-1, rf, *input_data.shape[1:])
    return squeeze_safe(data, [0, 1])


def tensor_parallel_output(output_data: np.ndarray, num_host_transfers: int, tp: int, rf: int,
                           data_shape: tuple[int, ...], tp_identical: bool = True,
                           true_num_host_transfers: int | None = None) -> np.ndarray:
    """Session output ``(num_host_transfers, rf, *data_shape)`` as ``(samples, *data_shape)``
    (``(samples, tp, *data_shape)`` when the ``tp`` replicas of a group differ).

    Raises:
        ValueError: ``tp`` is larger than ``rf`` or does not divide it.
    """
    _check_tp(tp, rf)
    data = output_data.reshape(num_host_transfers, rf // tp, tp, *data_shape)
    if true_num_host_transfers is not None:
        data = data[:true_num_host_transfers]
    data = data.reshape(-1, tp, *data_shape)
    return data[:, 0] if tp_identical else data


def pad_axis(x: np.ndarray, n: int, axis: int, value: int | float = 0) -> np.ndarray:
    """``x`` padded at the end of ``axis`` with ``value`` to length ``n``.

    Raises:
        ValueError: ``axis`` is already longer than ``n``.
    """
    if x.shape[axis] > n:
        raise ValueError(f"pad_axis: axis {axis} has length {x.shape[axis]}, longer than {n}")
    padding = [(0, 0)] * x.ndim
    padding[axis] = (0, n - x.shape[axis])
    return np.pad(x, padding, constant_values=value)


def squeeze_safe(x: np.ndarray, axis: int | Sequence[int] | None = None) -> np.ndarray:
    """``np.squeeze`` that leaves the given axes whose length is not 1 alone instead of raising."""
    if axis is None:
        return np.squeeze(x)
    axes = {handle_negative_axis(x, a) for a in ([axis] if isinstance(axis, int) else axis)}
    ones = sorted(a for a in axes if x.shape[a] == 1)
    return np.squeeze(x, axis=tuple(ones)) if ones else x
