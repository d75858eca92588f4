"""``GraphWithNamedArgs`` (a graph and its named inputs) and ``BoundGraph`` (a graph
with some inputs bound to tensors), as in popxl.addons.

Several ``BoundGraph``s can share one graph: each call is an ``ops.call`` of the
same graph with other tensors, so the graph's code exists once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping

from ipuxl.addons_compat.grad_graph import Aux
from ipuxl.addons_compat.named_tensors import NamedTensors, TensorMap
from ipuxl.errors import AutodiffError, InvalidArgumentError
from ipuxl.ir import context
from ipuxl.ir.grad_info import GradGraphInfo
from ipuxl.ir.graph import Graph
from ipuxl.ir.meta import BY_REF, OP
from ipuxl.ir.printer import format_schedule
from ipuxl.ir.tensor import Constant, Tensor, Variable
from ipuxl.ops.call import CallSiteInfo, call_with_info

if TYPE_CHECKING:
    from ipuxl.addons_compat.module import Module

__all__ = ["GraphWithNamedArgs", "BoundGraph", "CalledGraphsGradInfo"]


class BoundGraph:
    """A graph plus tensors bound to some of its inputs (``{graph input: tensor}``)."""

    def __init__(self, graph: Graph, args: TensorMap | None = None):
        self.graph = graph
        self.args = dict(args or {})

    def call(self, *targs: Any, args: TensorMap | None = None) -> tuple[Tensor, ...]:
        """Call the graph: ``targs`` fill the unbound inputs in order; ``args`` add or override bindings."""
        return self.call_with_info(*targs, args=args).outputs

    def call_with_info(self, *targs: Any, args: TensorMap | None = None) -> CallSiteInfo:
        """Call the graph (see ``call``) and return the ``CallSiteInfo`` of the call site.

        Raises:
            InvalidArgumentError: a by-reference input (positional or bound) gets a
                constant or a main-graph tensor that is not a variable.
        """
        inputs = {**self.args, **(args or {})}
        positional = [v for arg in targs for v in (arg if isinstance(arg, (list, tuple)) else [arg])]
        _check_by_ref_inputs(self.graph, {**dict(zip(self.graph.inputs, positional)), **inputs})
        return call_with_info(self.graph, *targs, inputs_dict=inputs)

    def bind(self, args: TensorMap) -> "BoundGraph":
        """A new BoundGraph with ``args`` bound as well (overriding existing bindings)."""
        return BoundGraph(self.graph, {**self.args, **args})

    def subgraph_io_map(self, *targs: Tensor, args: TensorMap | None = None,
                        outs: Iterable[Tensor] = ()) -> dict[Tensor, Tensor]:
        """``{graph input: call input}`` for all inputs and ``{graph output: call output}``."""
        inputs = {**self.args, **(args or {})}
        inputs.update(zip(self.graph.inputs, targs))
        return {**dict(zip(self.graph.outputs, outs)), **inputs}


def _check_by_ref_inputs(graph: Graph, inputs: Mapping[Tensor, Any]) -> None:
    """A by-reference input is updated in place: it must receive a variable (or, in a
    subgraph, a tensor of that subgraph), never a constant."""
    for graph_input, value in inputs.items():
        if not graph_input.node.meta.get(BY_REF) or not isinstance(value, Tensor):
            continue
        if isinstance(value, Constant) or (value.graph.is_main and not isinstance(value, Variable)
                                           and not _is_state(value)):
            raise InvalidArgumentError(
                f"input '{graph_input.name}' of graph '{graph.name}' is passed by reference (it is updated in "
                f"place) but got '{value.name}', which is not a variable", where=context.user_source_line(),
                fix="pass a variable (e.g. from factories.init()); an update of a temporary or constant is lost")


#: Ops whose main-graph results are state a program updates in place and then uses:
#: loaded from Streaming Memory (directly or by a called load graph), made by ops.init
#: (gradient accumulators), or a replica's shard (RTS); not, say, ``var + 1.0``.
_STATE_OPS = frozenset({"remote_load", "output_of", "call", "init", "replica_sharded_slice"})


def _is_state(value: Tensor) -> bool:
    return bool(value.meta_shape) or value.node.meta.get(OP) in _STATE_OPS


class CalledGraphsGradInfo:
    """The gradient graphs a module's graph calls, by called graph (upstream's
    ``_CalledGraphsGradInfoRefs``): a module's own entries plus its submodules' maps,
    held by reference so entries submodules add while building are seen."""

    def __init__(self, entries: Mapping[Any, Any] | None = None):
        self.map: dict[Graph, GradGraphInfo] = dict(_normalised(g, i) for g, i in (entries or {}).items())
        self.submaps: list[CalledGraphsGradInfo] = []

    def add(self, fwd_graph: Any, grad_graph: Any) -> None:
        """Record ``grad_graph`` (a GradGraphInfo or gradient GraphWithNamedArgs) for ``fwd_graph``."""
        graph, info = _normalised(fwd_graph, grad_graph)
        self.map[graph] = info

    def add_submap(self, other: "CalledGraphsGradInfo | Mapping[Any, Any]") -> None:
        self.submaps.append(other if isinstance(other, CalledGraphsGradInfo) else CalledGraphsGradInfo(other))

    def consolidate(self) -> dict[Graph, GradGraphInfo]:
        """One ``{called graph: GradGraphInfo}``; the module's own entries win over submodules'."""
        merged: dict[Graph, GradGraphInfo] = {}
        for sub in self.submaps:
            merged.update(sub.consolidate())
        merged.update(self.map)
        return merged

    def clear(self) -> None:
        for sub in self.submaps:
            sub.clear()
        self.map, self.submaps = {}, []


def _normalised(fwd_graph: Any, grad_graph: Any) -> tuple[Graph, GradGraphInfo]:
    graph = fwd_graph if isinstance(fwd_graph, Graph) else fwd_graph.graph
    info = grad_graph if isinstance(grad_graph, GradGraphInfo) else grad_graph.grad_graph_info
    return graph, info


class GraphWithNamedArgs:
    """A graph and the tensors (``args``) of its named inputs.

    Attributes:
        graph: the ipuxl Graph.
        args: NamedTensors of the graph's named inputs (its state).
    """

    def __init__(self, graph: Graph, args: NamedTensors | None = None,
                 grad_graph_info: GradGraphInfo | None = None, from_module: "Module | None" = None,
                 aux: "Aux | None" = None, called_graphs_grad_info: Mapping[Any, Any] | None = None):
        self.graph = graph
        self.args = args if args is not None else NamedTensors()
        self._grad_graph_info = grad_graph_info
        self._from_module = from_module
        self.aux = aux if aux is not None else Aux()
        self.called_graphs_grad_info: dict[Graph, GradGraphInfo] = dict(
            _normalised(g, i) for g, i in (called_graphs_grad_info or {}).items())
        """The gradient graphs of the graphs this graph calls (``Module.call_module`` records
        them), used by ``autodiff``; a graph whose gradient is hand-written must be here."""
        self.autodiff_applied = False

    @property
    def from_module(self) -> "Module | None":
        """The module whose ``create_graph`` made this graph, if any."""
        return self._from_module

    @classmethod
    def from_grad_graph(cls, grad_graph_info: GradGraphInfo, args: NamedTensors | None = None) -> "GraphWithNamedArgs":
        return cls(grad_graph_info.graph, args, grad_graph_info)

    def bind(self, args: NamedTensors | None = None) -> BoundGraph:
        """Bind the named inputs to ``args`` (same keys as ``self.args``).

        Raises:
            InvalidArgumentError: ``args`` lacks some keys of ``self.args`` or has extra ones.
        """
        if args is None:
            return BoundGraph(self.graph)
        expected, given = set(self.args.keys_flat()), set(args.keys_flat())
        if expected != given:
            raise InvalidArgumentError(
                f"cannot bind graph '{self.graph.name}': missing keys {sorted(expected - given)}, "
                f"extra keys {sorted(given - expected)}",
                fix="bind the NamedTensors made by the factories of this graph (facts.init())")
        return BoundGraph(self.graph, self.args.to_mapping(args))

    def call(self, *targs: Any, args: TensorMap | None = None) -> tuple[Tensor, ...]:
        """Call the graph with no bound arguments (pass named inputs in ``args``)."""
        return self.bind().call(*targs, args=args)

    def call_with_info(self, *targs: Any, args: TensorMap | None = None) -> CallSiteInfo:
        return self.bind().call_with_info(*targs, args=args)

    def autodiff(self, method: Literal["auto", "build_grad", "autodiff"] = "auto",
                 grads_provided: Iterable[Tensor] | None = None, grads_required: Iterable[Tensor] | None = None,
                 called_graphs_grad_info: Mapping[Any, Any] | None = None, *,
                 force: bool = False) -> "GraphWithNamedArgs":
        """The gradient graph, once per graph (unless ``force``, an ipuxl addition).

        ``method``: "build_grad" uses the ``build_grad`` of the module that made the graph
        (``from_module``); "autodiff" the autodiff transform, with this graph's
        ``called_graphs_grad_info`` and ``called_graphs_grad_info``; "auto" (default)
        "build_grad" when the module implements it, else "autodiff".

        Raises:
            AutodiffError: (a ValueError) autodiff was already applied, "build_grad" without
                ``from_module``, or an unknown method.
        """
        from ipuxl.addons_compat.transforms.autodiff import transform_autodiff  # a cycle at import

        if self.autodiff_applied and not force:
            raise AutodiffError(
                f"Autodiff has already been applied to graph '{self.graph.name}'. It modifies the forward graph "
                "(adds outputs), so it cannot be applied twice", where=context.user_source_line(),
                fix="keep the first gradient graph (ipuxl: pass force=True to apply it again)")
        module = self._from_module
        if method == "auto":
            method = "build_grad" if module is not None and module.implements_grad_graph else "autodiff"
        if method == "build_grad":
            if module is None:
                raise AutodiffError(
                    f"autodiff(method='build_grad') of graph '{self.graph.name}' is only possible if `from_module` "
                    "is specified (the module whose build_grad writes the gradient)", where=context.user_source_line(),
                    fix="create the graph with Module.create_graph, or use method='autodiff'")
            grad = module.create_grad_graph(self, grads_provided, grads_required)
        elif method == "autodiff":
            called = {**self.called_graphs_grad_info,
                      **dict(_normalised(g, i) for g, i in (called_graphs_grad_info or {}).items())}
            grad = transform_autodiff(self, grads_provided, grads_required, called)
        else:
            raise AutodiffError(f"autodiff method should be one of 'auto', 'build_grad', 'autodiff'. Not: {method!r}",
                                where=context.user_source_line())
        self.autodiff_applied = True
        return grad

    @property
    def grad_graph_info(self) -> GradGraphInfo:
        """The ``GradGraphInfo`` of a gradient graph (made by autodiff)."""
        if self._grad_graph_info is None:
            raise AttributeError(f"graph '{self.graph.name}' is not a gradient graph: it has no grad_graph_info")
        return self._grad_graph_info

    @grad_graph_info.setter
    def grad_graph_info(self, info: GradGraphInfo) -> None:
        self._grad_graph_info = info

    def copy(self) -> "GraphWithNamedArgs":
        return GraphWithNamedArgs(self.graph, self.args.copy(), self._grad_graph_info, self._from_module,
                                  self.aux.copy(), self.called_graphs_grad_info)

    def print_schedule(self) -> str:
        """The schedule in popxl.addons' text form, named inputs shown as ``name=%k``."""
        return format_schedule(self.graph, {t: name for name, t in self.args.to_dict().items()})
