"""Moving tensors between IPUs: ``ipu_copy`` (PopXL's) and ``io_tile_copy``.

A copy is one op whose result lives on the destination IPU (``ipuxl.ir.placement``).
Its node calls ``kernels.ipu_copy.ipu_copy(t, source, destination)``, so the device's
accounting reads both IPUs from the node's arguments (cross-IPU copy bytes in
``session.report()``). On the simulated device a copy is a clone: values are
unchanged, and autodiff differentiates it as the identity.
"""
from __future__ import annotations

import torch

from ipuxl.errors import InvalidArgumentError, PlacementError
from ipuxl.ir import context, placement
from ipuxl.ir.build import emit
from ipuxl.ir.graph import describe
from ipuxl.ir.meta import IPU
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import ipu_copy as kernels

__all__ = ["ipu_copy", "io_tile_copy"]


def _check_ipu(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlacementError(f"ipu_copy: {what} must be an IPU id (an int >= 0), got {value!r}",
                             where=context.user_source_line(), fix=f"pass {what}=0, 1, ...")
    return value


def ipu_copy(t: Tensor, destination: int, source: int | None = None) -> Tensor:
    """Copy ``t`` to IPU ``destination`` (PopXL's ``ops.ipu_copy``).

    Args:
        t: the tensor to copy.
        destination: the IPU the copy lives on.
        source: the IPU ``t`` lives on; by default the IPU of the op that made ``t``.

    Returns:
        A new tensor on ``destination`` with ``t``'s values.

    Raises:
        PlacementError: (a ValueError, as PopXL's) ``source`` is not given and ``t`` has no
            producer to infer it from (a subgraph input, a constant), or ``source``
            contradicts where ``t`` lives.

    Example:
        >>> with ir.main_graph, ipuxl.ipu(0):
        ...     y = ops.ipu_copy(x * 2, 1)   # y lives on IPU 1
    """
    if not isinstance(t, Tensor):
        raise InvalidArgumentError(f"ipu_copy needs a Tensor to copy, got {describe(t)}",
                                   where=context.user_source_line())
    destination = _check_ipu(destination, "destination")
    lives_on = placement.ipu_of(t.node)
    if source is None:
        if lives_on is None:
            raise PlacementError(
                f"Could not infer the ipu for Tensor to be copied '{t.name}': it has no producer "
                "(a graph input, a constant or a variable built outside every ipu(n) context, or an op built "
                "under popxl.ipu(None)). Please specify `source`",
                where=context.user_source_line(), fix="specify `source` when copying: ops.ipu_copy(t, destination, source=...)")
        source = lives_on
    source = _check_ipu(source, "source")
    if lives_on is not None and lives_on != source and t.graph.is_main:
        raise PlacementError(
            f"ipu_copy of '{t.name}' from IPU {source}, but the tensor lives on IPU {lives_on}",
            where=context.user_source_line(), fix=f"pass source={lives_on} (or leave it out to infer it)")
    with placement.unchecked():
        copied = emit("ipu_copy", kernels.ipu_copy, (t, source, destination), name=f"{t.name}_c")
    copied.node.meta[IPU] = destination
    return copied


def io_tile_copy(t: Tensor) -> Tensor:
    """Copy ``t`` between the compute tiles and the I/O tiles of its IPU (PopXL's
    ``ops.io_tile_copy``).

    The simulation treats I/O tiles as ordinary tiles, so this is a copy on the same
    IPU (a new tensor with ``t``'s values).
    """
    if not isinstance(t, Tensor):
        raise InvalidArgumentError(f"io_tile_copy needs a Tensor, got {describe(t)}",
                                   where=context.user_source_line())
    return emit("io_tile_copy", torch.clone, (t,), name=f"{t.name}_io")
