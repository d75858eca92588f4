"""PopXL's ``transforms``: ``autodiff`` and the ``GradGraphInfo`` it returns."""
from __future__ import annotations

from enum import Enum
from typing import Iterable, Mapping

from ipuxl.errors import AutodiffError
from ipuxl.ir.graph import Graph
from ipuxl.ir.tensor import Tensor
from ipuxl.ops.call import CallSiteInfo
from ipuxl.passes.autodiff import differentiate, differentiated_callees

__all__ = ["autodiff", "GradGraphInfo", "ExpectedConnection", "ExpectedConnectionType"]


class ExpectedConnectionType(Enum):
    """What a grad-graph input or output connects to: a forward tensor or its gradient."""

    Fwd = "Fwd"
    FwdGrad = "FwdGrad"


class ExpectedConnection:
    """One grad-graph input/output: ``fwd_tensor`` (of the forward graph) and its role."""

    def __init__(self, fwd_tensor: Tensor, connection_type: ExpectedConnectionType):
        self.fwd_tensor = fwd_tensor
        self.connection_type = connection_type

    def __repr__(self) -> str:
        return f"({self.connection_type.value}, {self.fwd_tensor.id})"


class GradGraphInfo:
    """The result of ``autodiff``: the grad graph and how to connect it.

    Attributes:
        graph: the grad graph. Inputs: gradients of ``grads_provided`` then forward
            activations; outputs: gradients of ``grads_required``.
        forward_graph: the differentiated graph (it gained activation outputs).
        expected_inputs / expected_outputs: one ``ExpectedConnection`` per grad-graph
            input / output.
    """

    def __init__(self, graph: Graph, forward_graph: Graph, expected_inputs: list[ExpectedConnection],
                 expected_outputs: list[ExpectedConnection]):
        self.graph = graph
        self.forward_graph = forward_graph
        self.expected_inputs = tuple(expected_inputs)
        self.expected_outputs = tuple(expected_outputs)

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(c.fwd_tensor for c in self.expected_inputs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(c.fwd_tensor for c in self.expected_outputs)

    def inputs_dict(self, fwd_call_info: CallSiteInfo) -> dict[Tensor, Tensor]:
        """Grad-graph activation inputs -> the parent tensors of the forward call site."""
        self._check_call(fwd_call_info)
        return {
            self.graph.inputs[i]: fwd_call_info.graph_to_parent(c.fwd_tensor)
            for i, c in enumerate(self.expected_inputs)
            if c.connection_type is ExpectedConnectionType.Fwd
        }

    def fwd_graph_ins_to_grad_parent_outs(self, grad_call_info: CallSiteInfo) -> dict[Tensor, Tensor]:
        """Forward-graph inputs -> the parent tensors holding their gradients."""
        outs = grad_call_info.outputs
        return {c.fwd_tensor: outs[i] for i, c in enumerate(self.expected_outputs)}

    def fwd_parent_ins_to_grad_parent_outs(self, fwd_call_info: CallSiteInfo,
                                           grad_call_info: CallSiteInfo) -> dict[Tensor, Tensor]:
        """Parent tensors given to the forward call -> parent tensors of their gradients."""
        self._check_call(fwd_call_info)
        return {fwd_call_info.graph_to_parent(fwd): grad
                for fwd, grad in self.fwd_graph_ins_to_grad_parent_outs(grad_call_info).items()}

    def _check_call(self, call_info: CallSiteInfo) -> None:
        if call_info.called_graph is not self.forward_graph:
            raise AutodiffError(
                f"the call site calls graph '{call_info.called_graph.name}', but this GradGraphInfo "
                f"differentiates '{self.forward_graph.name}'",
                fix="pass the CallSiteInfo of a call of the differentiated graph")

    def __repr__(self) -> str:
        ins = "\n".join(f"    {c}" for c in self.expected_inputs)
        outs = "\n".join(f"    {c}" for c in self.expected_outputs)
        return (f"GradGraphInfo[\n  graph={self.graph.name}\n  expected_inputs=[\n{ins}\n  ]\n"
                f"  expected_outputs=[\n{outs}\n  ]\n]")


def autodiff(graph: Graph, grads_provided: Iterable[Tensor] | None = None,
             grads_required: Iterable[Tensor] | None = None,
             called_graphs_grad_info: Mapping[Graph, GradGraphInfo] | None = None,
             return_all_grad_graphs: bool = False) -> GradGraphInfo | dict[Graph, GradGraphInfo]:
    """Differentiate ``graph`` (PopXL's ``transforms.autodiff``).

    Args:
        graph: the forward subgraph.
        grads_provided: outputs whose gradients the caller provides (default: all
            floating-point outputs).
        grads_required: inputs whose gradients the grad graph returns (default: all
            floating-point inputs).
        called_graphs_grad_info: accepted for compatibility and not used: each graph
            ``graph`` calls is differentiated once by this call, in place (it gains
            outputs for its saved activations), and its calls stay calls in the
            forward and grad graphs (see ``passes.autodiff``); loop bodies and graphs
            that modify their inputs are traced through instead.
        return_all_grad_graphs: return ``{graph: info}`` for ``graph`` and every
            called graph this call differentiated, instead of the info.

    Returns:
        A ``GradGraphInfo``. The forward graph gains outputs for the activations the
        grad graph needs; the backward never recomputes the forward.

    Raises:
        AutodiffError: a requested gradient has no differentiable path, a tensor is
            not an input/output of ``graph``, or there is nothing to differentiate:
            no floating-point output (of the graph, or in ``grads_provided``) or,
            with the default ``grads_required``, no floating-point input. Checked
            before anything is traced.
    """
    _refuse_collectives(graph)
    provided = list(grads_provided) if grads_provided is not None else None
    required = list(grads_required) if grads_required is not None else None
    differentiate(graph, provided, required)
    if not return_all_grad_graphs:
        return _grad_info(graph)
    return {g: _grad_info(g) for g in [graph, *differentiated_callees(graph)]}


def _grad_info(graph: Graph) -> GradGraphInfo:
    grad_graph, inputs, outputs = graph._ipuxl_grad
    return GradGraphInfo(
        grad_graph, graph,
        [ExpectedConnection(t, ExpectedConnectionType(kind)) for t, kind in inputs],
        [ExpectedConnection(t, ExpectedConnectionType.FwdGrad) for t in outputs],
    )


def _refuse_collectives(graph: Graph, seen: set | None = None) -> None:
    """Collectives have no gradient rule yet: say so instead of failing inside the trace."""
    from ipuxl.ir.calls import CallTarget
    from ipuxl.ir.meta import COLLECTIVE_OPS

    seen = set() if seen is None else seen
    seen.add(graph)
    for node in graph.fx.nodes:
        if node.meta.get("ipuxl_op") in COLLECTIVE_OPS:
            raise AutodiffError(
                f"autodiff of graph '{graph.name}': it contains {node.meta['ipuxl_op']} ('{node.name}'), "
                "and differentiating through collectives is not supported",
                where=node.meta.get("ipuxl_source"),
                fix="differentiate the per-replica computation, then all-reduce its gradients in the caller "
                    "(ops.collectives.replicated_all_reduce_(grad, 'mean')), the usual data-parallel pattern")
        if isinstance(node.target, CallTarget) and node.target.graph not in seen:
            _refuse_collectives(node.target.graph, seen)
