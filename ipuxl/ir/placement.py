"""Placement: which IPU (PopART virtual graph) each op and variable lives on.

PopXL places ops with ``with popxl.ipu(n):``; every op and variable built in that
context records ``n`` in ``node.meta[ipuxl.ir.meta.IPU]`` (absent: IPU 0). A tensor
lives where the op that made it ran, except the result of ``ops.ipu_copy``, which
lives on the destination IPU. PopART refuses a program in which an op reads a
tensor of another IPU without a copy; ``check_inputs`` raises the same refusal at
build time, naming both IPUs and the tensor.

Where checks apply: ops of the main graph. A subgraph runs on the IPU of the op that
calls it (its inputs come from the caller, and one graph may be called on several
IPUs), so its ops are stamped but not checked; a call (or repeat) built outside every
``ipu(n)`` context is not checked either, and its results are wildcards: its graph may
span IPUs (popxl.addons' within-replica sharded ops are such graphs); graph inputs and constants are
wildcards (a constant is materialised on the IPU that reads it), and so is a
variable built outside every ``ipu(n)`` context (PopART places a variable with the ops
that read it).

``popxl.io_tiles()`` and ``ops.io_tile_copy`` are accepted: the simulation treats
I/O tiles as ordinary tiles of the same IPU (no separate memory, no overlap).
"""
from __future__ import annotations

import contextlib
import operator
from typing import TYPE_CHECKING, Any, Iterator

import torch.fx as fx
from torch.utils._pytree import tree_map

from ipuxl.errors import PlacementError
from ipuxl.ir import context
from ipuxl.ir.meta import IPU, NAME, OP, TILE_SET

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir

__all__ = ["ipu", "io_tiles", "current_ipu", "ipu_of", "tile_set_of", "stamp", "check_inputs", "num_ipus",
           "unchecked", "in_io_tiles", "SPANNING_OPS"]

#: ops that run a graph: built outside every ``ipu(n)`` context, they read and write tensors of
#: any IPU (the graph's ops carry their own placement) and their results are wildcards
SPANNING_OPS = ("call", "repeat")

_ipu_stack: list[int | None] = []
_io_tiles_stack: list[bool] = []
_unchecked_depth: list[bool] = []


@contextlib.contextmanager
def ipu(ipu: int | None) -> Iterator[None]:
    """Place the ops and variables built in this context on IPU ``ipu`` (PopXL's ``popxl.ipu``).

    Contexts nest; the innermost wins. Outside every context ops are on IPU 0.
    ``ipu(None)`` records no IPU, as PopXL's (not recommended): such tensors have no
    ``Tensor.ipu`` and ``ops.ipu_copy`` needs their ``source``.

    Raises:
        PlacementError: (a ValueError) ``ipu`` is not None or an int >= 0.

    Example:
        >>> with ir.main_graph, ipuxl.ipu(1):
        ...     y = x.copy_to_ipu(1) * 2   # built on IPU 1
    """
    if ipu is not None and (isinstance(ipu, bool) or not isinstance(ipu, int) or ipu < 0):
        raise PlacementError(f"popxl.ipu needs an IPU id, an int >= 0; got {ipu!r}",
                             where=context.user_source_line(), fix="use popxl.ipu(0), popxl.ipu(1), ...")
    _ipu_stack.append(ipu)
    try:
        yield
    finally:
        _ipu_stack.pop()


@contextlib.contextmanager
def io_tiles() -> Iterator[None]:
    """Run the ops of this context on the current IPU's I/O tiles (PopXL's ``popxl.io_tiles``).

    Accepted for compatibility: ipuxl simulates I/O tiles as ordinary tiles of the same
    IPU, so placement, memory and results are those of the IPU's compute tiles.
    """
    _io_tiles_stack.append(True)
    try:
        yield
    finally:
        _io_tiles_stack.pop()


def in_io_tiles() -> bool:
    """Whether an ``io_tiles()`` context is open."""
    return bool(_io_tiles_stack)


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Build ops without placement checks (transforms that move already-checked ops)."""
    _unchecked_depth.append(True)
    try:
        yield
    finally:
        _unchecked_depth.pop()


def current_ipu() -> int | None:
    """The IPU of the innermost ``ipu(n)`` context, or None outside every one (or in ``ipu(None)``)."""
    return _ipu_stack[-1] if _ipu_stack else None


def stamp(node: fx.Node, op: bool = False) -> None:
    """Record the current IPU on ``node`` (an op or variable just built); ``op``: also its tile set."""
    if _ipu_stack:
        node.meta[IPU] = _ipu_stack[-1]
    if op:
        node.meta[TILE_SET] = "io" if _io_tiles_stack else "compute"


def tile_set_of(node: fx.Node) -> str | None:
    """``"compute"`` or ``"io"`` for an op's value; None (undefined) for inputs, variables and constants."""
    if TILE_SET in node.meta:
        return str(node.meta[TILE_SET])
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return tile_set_of(node.args[0])
    return None


def ipu_of(node: fx.Node) -> int | None:
    """The IPU ``node``'s value lives on; None for a wildcard (a subgraph input, a
    constant, a host-stream slot, an unplaced variable: they live wherever they are read,
    or an op built under ``ipu(None)``)."""
    if IPU in node.meta:
        return None if node.meta[IPU] is None else int(node.meta[IPU])
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return ipu_of(node.args[0])
    if node.op in ("placeholder", "get_attr"):
        return None  # an input, a constant, or a variable built outside every ipu(n) context
    if node.meta.get(OP) in SPANNING_OPS:
        return None  # a call built outside every ipu(n) context: its graph's ops carry their placement
    return 0


def check_inputs(graph: "Graph", op_name: str, args: Any, kwargs: Any) -> None:
    """Raise ``PlacementError`` if an op built now in ``graph`` reads a tensor of another IPU.

    Only the main graph is checked (see the module docstring); ``ipu_copy`` is built
    under ``unchecked()``.
    """
    if _unchecked_depth or not graph.is_main:
        return
    if op_name in SPANNING_OPS and current_ipu() is None:
        return  # a call outside every ipu(n) context runs each op of its graph where that op is placed
    here = current_ipu() or 0
    tiles_here = "io" if _io_tiles_stack else "compute"
    from ipuxl.ir.tensor import Tensor  # tensor imports context only; keep this module light

    def check(value: Any) -> Any:
        if isinstance(value, Tensor):
            there, tiles_there = ipu_of(value.node), tile_set_of(value.node)
            if tiles_there is not None and tiles_there != tiles_here:
                name = value.node.meta.get(NAME, value.node.name)
                raise PlacementError(
                    f"op '{op_name}' is built on the {tiles_here} tiles but reads tensor '{name}', which lives on "
                    f"the {tiles_there} tiles; the tile sets differ (PopART refuses this program)",
                    where=context.user_source_line(),
                    fix="copy it first with ops.io_tile_copy(t), or build the op in the same tile set")
            if there is not None and there != here:
                name = value.node.meta.get(NAME, value.node.name)
                raise PlacementError(
                    f"op '{op_name}' is built on IPU {here} but reads tensor '{name}', which lives on IPU {there}; "
                    "an op can only read tensors of its own IPU (PopART refuses this program)",
                    where=context.user_source_line(),
                    fix=f"copy it first: t = ops.ipu_copy(t, {here}) (or t.copy_to_ipu({here})), or build the op "
                        f"under `with popxl.ipu({there}):`")
        return value

    tree_map(check, (args, kwargs))


def num_ipus(ir: "Ir") -> int:
    """How many IPUs a program uses: 1 + the largest IPU id of any op or variable."""
    largest = 0
    for graph in ir.graphs:
        for node in graph.fx.nodes:
            if node.meta.get(IPU) is not None:
                largest = max(largest, int(node.meta[IPU]))
    return largest + 1
