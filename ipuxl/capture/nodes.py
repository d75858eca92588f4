"""Typed reads of a traced fx graph (make_fx's output): its placeholders, the nodes it
returns and their shapes."""
from __future__ import annotations

from typing import cast

import torch.fx as fx

from ipuxl.ir.tensor import TensorSpec

__all__ = ["spec_of", "output_nodes", "placeholders"]


def spec_of(node: fx.Node) -> TensorSpec:
    """Shape and dtype of a traced node's value (its ``"val"`` meta tensor)."""
    val = node.meta["val"]
    return TensorSpec(tuple(val.shape), val.dtype)


def output_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes a traced graph returns, in order (make_fx returns a flat list of tensors)."""
    returned = graph.output_node().args[0]
    assert isinstance(returned, (list, tuple)) and all(isinstance(n, fx.Node) for n in returned), returned
    return cast(list[fx.Node], list(returned))


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    """The graph's placeholders, in order."""
    return [node for node in graph.nodes if node.op == "placeholder"]
