"""PopXL's ``transforms``: ``autodiff`` and the ``GradGraphInfo`` it returns, and
``decompose_sum``.

The transform is the autodiff pass (``ipuxl.passes.autodiff``); its result types
live with the IR (``ipuxl.ir.grad_info``). This module only gives them PopXL's names.
"""
from ipuxl.ir.grad_info import ExpectedConnection, ExpectedConnectionType, GradGraphInfo
from ipuxl.ir.graph import Graph
from ipuxl.passes.autodiff import autodiff

__all__ = ["autodiff", "GradGraphInfo", "ExpectedConnection", "ExpectedConnectionType", "decompose_sum"]


def decompose_sum(graph: Graph) -> Graph:
    """PopXL's ``decompose_sum``: returns ``graph``.

    Upstream rewrites the sums of many tensors that autodiff makes (a gradient read by
    several ops) into a chain of additions, each done as soon as its operands exist, so
    fewer gradients are live at once. It changes when the additions run on an IPU, not
    their values; ipuxl's grad graphs add gradients pairwise already and the device
    schedules for memory itself, so there is nothing to rewrite.
    """
    return graph
