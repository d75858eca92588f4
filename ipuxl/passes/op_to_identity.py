"""Replace ops that can be replaced by an identity (PopART's ``OpToIdentityPattern``).

PopART's pre-alias pattern of that name turns every op whose ``canBeReplacedByIdentity()``
holds into an Identity op. Most such ops (a reshape to the same shape, a scale by one)
already compute the identity here, so only the ones whose meaning changes are matched:
popxl.addons' tensor-parallel all-reduces with identical inputs
(``ipuxl.kernels.tp_collectives``), which do not run until the pattern has made them
identities.

Preconditions: none (any IR graph). Algorithm, per node in program order:

1. match a TP all-reduce whose ``identical_inputs`` argument is set;
2. make it an ``identity`` op of its input (``torch.clone``, as ``ops.identity``): the
   node, its name and its users stay, so every handle to its output stays valid.

As in PopART the pattern does not look at the gradient: run it after ``autodiff``, or the
grad graph is built from the identity and loses the all-reduce.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ipuxl.ir.meta import OP
from ipuxl.kernels.tp_collectives import can_be_replaced_by_identity
from ipuxl.passes.result import PassResult

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["replace_ops_by_identity"]


def replace_ops_by_identity(graph: "Graph") -> PassResult:
    """Make every op of ``graph`` that can be replaced by an identity an ``identity`` op.

    Returns:
        ``PassResult(graph, modified)``; the graph is changed in place.
    """
    modified = False
    for node in graph.fx.nodes:
        # step 1: the ops whose canBeReplacedByIdentity() holds
        if node.op != "call_function" or not can_be_replaced_by_identity(node.target, tuple(node.args)):
            continue
        # step 2: the same node, now an identity of its input
        node.target = torch.clone
        node.args, node.kwargs = (node.args[0],), {}
        node.meta[OP] = "identity"
        modified = True
    return PassResult(graph, modified)
