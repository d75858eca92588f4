"""The host-transfer kernels: what ``ops.host_load`` records, and the cursors a run reads.

In the IR a host load is one op whose target is ``host_load``: it only stands for
"the next slice of this stream". A ``Session`` lowers every load (and every
``host_store`` slot) to ``next(host_io[k])``, where ``host_io`` is the run's list of
per-stream cursors (``stream_cursors``): iterators over the staged host buffer's
slices, so a load in a loop body costs one list index and one ``next`` call.

A branch of ``ops.conditional`` gets its cursors through ``gate_cursors``: the run's own
when the branch is taken, else blank ones, so only the taken branch's transfers take
(or give) slices of the run's streams.
"""
from __future__ import annotations

import itertools
import operator
from typing import Iterator, Sequence

import torch

from ipuxl.errors import DeviceError

__all__ = ["host_load", "stream_cursors", "consumed", "gate_cursors"]


def host_load(stream_name: str) -> torch.Tensor:
    """The IR target of ``ops.host_load``; only a ``Session`` can run it (it lowers the op)."""
    raise DeviceError(
        f"host_load of stream '{stream_name}' ran outside a Session: host data exists only while a "
        "Session runs the program",
        fix="run the program with ipuxl.Session(ir).run({stream: data}); autodiff and other passes cannot "
            "trace graphs that load host data: load in the caller and pass the tensor in")


def stream_cursors(buffers: Sequence[torch.Tensor]) -> list[Iterator[torch.Tensor]]:
    """One cursor per stream: an iterator over the slices (dim 0) of its run buffer."""
    return [iter(buffer.unbind(0)) for buffer in buffers]


def consumed(cursor: Iterator[torch.Tensor], total: int) -> int:
    """How many slices of ``total`` a cursor from ``stream_cursors`` has given out."""
    return total - operator.length_hint(cursor)


def _blanks(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Iterator[torch.Tensor]:
    return (torch.zeros(shape, dtype=dtype, device=device) for _ in itertools.count())


def gate_cursors(cursors: Sequence[Iterator[torch.Tensor]], flag: torch.Tensor, taken_when: bool,
                 slices: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> Sequence[Iterator[torch.Tensor]]:
    """The cursors a conditional's branch gets: ``cursors`` when ``flag`` (the condition, one
    element) equals ``taken_when``, else one blank cursor per stream giving zero slices of
    ``slices[k]``'s shape and dtype (a load reads zeros, a store writes a scratch slice), so
    the run's streams are untouched by the branch not taken."""
    if bool(flag.reshape(())) == taken_when:
        return cursors
    return [_blanks(shape, dtype, flag.device) for shape, dtype in slices]
