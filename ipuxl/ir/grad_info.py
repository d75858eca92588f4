"""What autodiff records about a differentiated graph: ``GradGraphInfo``.

``passes.autodiff.differentiate`` returns one and stores it on the forward graph
(``Graph.grad_info``); ``ipuxl.transforms`` re-exports these types under PopXL's names.
"""
from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Iterable

from ipuxl.errors import AutodiffError
from ipuxl.ir.tensor import Tensor

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ops.call import CallSiteInfo

__all__ = ["ExpectedConnectionType", "ExpectedConnection", "GradGraphInfo"]


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
            input / output (tuples, read-only views of the lists ``_expected_inputs`` /
            ``_expected_outputs``, as PopXL keeps them: popxl.addons' code and tests read those).
    """

    def __init__(self, graph: "Graph", forward_graph: "Graph", expected_inputs: Iterable[ExpectedConnection],
                 expected_outputs: Iterable[ExpectedConnection]):
        self.graph = graph
        self.forward_graph = forward_graph
        self._expected_inputs: list[ExpectedConnection] = list(expected_inputs)
        self._expected_outputs: list[ExpectedConnection] = list(expected_outputs)

    @classmethod
    def of(cls, graph: "Graph", forward_graph: "Graph", gradients_of: Iterable[Tensor],
           saved: Iterable[Tensor], required: Iterable[Tensor]) -> "GradGraphInfo":
        """The info of a grad graph whose inputs are the gradients of ``gradients_of`` then
        the forward tensors ``saved``, and whose outputs are the gradients of ``required``."""
        fwd_grad, fwd = ExpectedConnectionType.FwdGrad, ExpectedConnectionType.Fwd
        inputs = [ExpectedConnection(t, fwd_grad) for t in gradients_of] + [ExpectedConnection(t, fwd) for t in saved]
        return cls(graph, forward_graph, inputs, [ExpectedConnection(t, fwd_grad) for t in required])

    @property
    def expected_inputs(self) -> tuple[ExpectedConnection, ...]:
        """One connection per grad-graph input: a forward tensor or the gradient of one."""
        return tuple(self._expected_inputs)

    @property
    def expected_outputs(self) -> tuple[ExpectedConnection, ...]:
        """One connection per grad-graph output: the forward tensor it is the gradient of."""
        return tuple(self._expected_outputs)

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(c.fwd_tensor for c in self.expected_inputs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(c.fwd_tensor for c in self.expected_outputs)

    def inputs_dict(self, fwd_call_info: "CallSiteInfo") -> dict[Tensor, Tensor]:
        """Grad-graph activation inputs -> the parent tensors of the forward call site."""
        self._check_call(fwd_call_info)
        return {
            self.graph.inputs[i]: fwd_call_info.graph_to_parent(c.fwd_tensor)
            for i, c in enumerate(self.expected_inputs)
            if c.connection_type is ExpectedConnectionType.Fwd
        }

    def fwd_graph_ins_to_grad_parent_outs(self, grad_call_info: "CallSiteInfo") -> dict[Tensor, Tensor]:
        """Forward-graph inputs -> the parent tensors holding their gradients."""
        outs = grad_call_info.outputs
        return {c.fwd_tensor: outs[i] for i, c in enumerate(self.expected_outputs)}

    def fwd_parent_ins_to_grad_parent_outs(self, fwd_call_info: "CallSiteInfo",
                                           grad_call_info: "CallSiteInfo") -> dict[Tensor, Tensor]:
        """Parent tensors given to the forward call -> parent tensors of their gradients."""
        self._check_call(fwd_call_info)
        return {fwd_call_info.graph_to_parent(fwd): grad
                for fwd, grad in self.fwd_graph_ins_to_grad_parent_outs(grad_call_info).items()}

    def _check_call(self, call_info: "CallSiteInfo") -> None:
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
