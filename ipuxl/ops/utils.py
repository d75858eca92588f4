"""PopXL's ``popxl.ops.utils``: the checks ops run on their inputs, for ops written by users.

``check_in_graph(graph, **tensors)`` raises unless every tensor belongs to ``graph``;
``check_tensor_ipu_and_tile_set(**tensors)`` unless the tensors with a defined IPU and
tile set agree on them (PopART refuses an op reading tensors of two IPUs or tile sets).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ipuxl.errors import PlacementError, WrongGraphError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.placement import ipu_of, tile_set_of
from ipuxl.ir.tensor import Tensor

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["check_in_graph", "check_tensor_ipu_and_tile_set"]


def check_in_graph(graph: "Graph", **tensors: Tensor) -> None:
    """Raise ``WrongGraphError`` (a ValueError) naming each tensor that is not in ``graph``."""
    outside = [f"{name} ({t.id}, graph '{t.graph.name}')" for name, t in tensors.items()
               if isinstance(t, Tensor) and t.graph is not graph]
    if outside:
        raise WrongGraphError(f"The following tensors are not in the graph {graph.name}: {', '.join(outside)}",
                              where=user_source_line(),
                              fix="pass tensors of the graph being built (subgraphs take values as graph inputs)")


def check_tensor_ipu_and_tile_set(**tensors: Tensor) -> None:
    """Raise ``PlacementError`` (a ValueError) unless the tensors are on one IPU and one tile set.

    Tensors without an IPU or tile set (variables, constants, graph inputs) are skipped
    for that property, as PopXL's.
    """
    for what, of in (("IPUs", ipu_of), ("tile sets", tile_set_of)):
        placed = {name: of(t.node) for name, t in tensors.items() if of(t.node) is not None}
        if len(set(placed.values())) > 1:
            listing = ", ".join(f"{name}: {value}" for name, value in placed.items())
            raise PlacementError(f"Not all tensors are located on the same {what}: {listing}",
                                 where=user_source_line(),
                                 fix="copy tensors between IPUs with ops.ipu_copy and between tile sets with "
                                     "ops.io_tile_copy first")
