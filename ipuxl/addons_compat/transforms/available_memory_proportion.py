"""popxl.addons' ``available_memory_proportion`` transform: set the available memory
proportion of every op that has one, per IPU.

PopART's matmuls, convolutions and gathers take an ``availableMemoryProportion``: the
share of an IPU's tile memory their Poplar plan may use for temporaries. It tunes how an
IPU computes the op, not what it computes. ipuxl's ops accept it and the simulated
device has no such plan, so these functions check the proportions (each in (0, 1], as
PopART requires) and leave the values computed unchanged.
"""
from __future__ import annotations

from typing import Iterable

from ipuxl.addons_compat.graph import GraphWithNamedArgs
from ipuxl.errors import InvalidValueError
from ipuxl.ir import context
from ipuxl.ir.graph import Graph
from ipuxl.ir.ir import Ir

__all__ = ["set_available_memory_proportion_by_ipu", "set_graph_available_memory_proportion_by_ipu"]


def set_available_memory_proportion_by_ipu(ir: Ir, proportions: Iterable[float]) -> None:
    """Set ``proportions[n]`` as the available memory proportion of the ops on IPU ``n``
    (``proportions[0]`` for IPUs past the end) in every graph of ``ir``.

    Raises:
        InvalidValueError: (a ValueError) no proportion, or one outside (0, 1].
    """
    _check(proportions)


def set_graph_available_memory_proportion_by_ipu(graph: Graph | GraphWithNamedArgs,
                                                 proportions: Iterable[float]) -> None:
    """As ``set_available_memory_proportion_by_ipu``, for ``graph`` and the graphs it calls."""
    _check(proportions)


def _check(proportions: Iterable[float]) -> list[float]:
    values = [float(p) for p in proportions]
    bad = [p for p in values if not 0 < p <= 1]
    if not values or bad:
        raise InvalidValueError(
            f"available memory proportions must be in (0, 1], one per IPU, got {values}",
            where=context.user_source_line(), fix="pass e.g. [0.6] (IPU 0, and every IPU without its own entry)")
    return values
