"""Graphs of the Streaming Memory helpers bind named arguments as popxl.addons does.

``GraphWithNamedArgs.bind`` in ipuxl insists on exactly the graph's keys (a guardrail
against typos). popxl.addons binds the keys the graph and the arguments share and
ignores the rest, and its phased-execution programs rely on it: they bind a layer's
whole tree (e.g. gradient accumulators with their counter, or variables the gradient
graph does not read) to graphs that take part of it. The graphs made by ``rts``,
``remote`` and batch serialisation therefore bind like upstream; a key of the graph
that the arguments lack still raises.
"""
from __future__ import annotations

from ipuxl.addons_compat.graph import BoundGraph, GraphWithNamedArgs
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir import context

__all__ = ["SubsetBindGraph"]


class SubsetBindGraph(GraphWithNamedArgs):
    """A ``GraphWithNamedArgs`` whose ``bind`` ignores argument keys the graph lacks."""

    def bind(self, args: NamedTensors | None = None) -> BoundGraph:
        """Bind the named inputs to the tensors of ``args`` with the same keys.

        Raises:
            InvalidArgumentError: ``args`` lacks some keys of ``self.args``.
        """
        if args is None:
            return BoundGraph(self.graph)
        missing = sorted(set(self.args.keys_flat()) - set(args.keys_flat()))
        if missing:
            raise InvalidArgumentError(f"cannot bind graph '{self.graph.name}': missing keys {missing}",
                                       where=context.user_source_line(),
                                       fix="bind a tree holding a tensor for each named input of the graph")
        return BoundGraph(self.graph, self.args.to_mapping(args))

    def copy(self) -> "SubsetBindGraph":
        return SubsetBindGraph(self.graph, self.args.copy(), self._grad_graph_info, self.from_module, self.aux.copy())
