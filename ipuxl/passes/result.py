"""The result every graph pass and device rewrite returns (as torch.fx's ``PassResult``).

A pass takes a graph and gives back the graph it produced, with a flag that says whether
anything changed. Passes that rewrite in place return the graph they were given. Callers
that run passes to a fixed point, or report what each rewrite did, read ``modified``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["PassResult"]


class PassResult(NamedTuple):
    """``graph``: the pass's output graph (an ``fx.Graph``, an ipuxl ``Graph`` or an ``Ir``);
    ``modified``: whether the pass changed anything."""

    graph: Any
    modified: bool
