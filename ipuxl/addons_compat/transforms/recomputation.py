"""popxl.addons' ``recompute_graph``: a gradient graph that recomputes its activations.

The new graph takes the forward graph's *inputs* instead of the activations the
gradient graph reads, calls the forward graph to recompute them, then calls the
gradient graph: memory for activations between forward and backward is traded for
running the forward twice.
"""
from __future__ import annotations

from ipuxl.addons_compat.graph import BoundGraph, GraphWithNamedArgs
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.ir.grad_info import ExpectedConnection, ExpectedConnectionType, GradGraphInfo
from ipuxl.ir.graph_builder import graph_input, graph_output
from ipuxl.ir.meta import BY_REF
from ipuxl.ir.tensor import Tensor

__all__ = ["recompute_graph", "add_recompute_inputs"]


def _input_like(tensor: Tensor, by_ref: bool = False) -> Tensor:
    return graph_input(tensor.shape, tensor.dtype, tensor.name, by_ref=by_ref, meta_shape=tensor.meta_shape)


def add_recompute_inputs(grad_info: GradGraphInfo) -> tuple[dict[Tensor, Tensor], dict[Tensor, Tensor],
                                                                list[ExpectedConnection]]:
    """Add the recomputing graph's inputs to the current graph, in ``expected_inputs`` order.

    Returns:
        forward-graph input -> new input; gradient-graph gradient input -> new input;
        the new graph's expected inputs (the gradients, then the forward inputs).
    """
    fwd_inputs: dict[Tensor, Tensor] = {}
    grad_inputs: dict[Tensor, Tensor] = {}
    expected: list[ExpectedConnection] = []
    forward = grad_info.forward_graph
    for index, connection in enumerate(grad_info.expected_inputs):
        if connection.connection_type is ExpectedConnectionType.FwdGrad:
            tensor = grad_info.graph.inputs[index]
            grad_inputs[tensor] = _input_like(tensor)
            expected.append(connection)
        elif connection.fwd_tensor in forward.inputs and connection.fwd_tensor not in fwd_inputs:
            fwd_inputs[connection.fwd_tensor] = _input_like(connection.fwd_tensor)
            expected.append(connection)
    for tensor in sorted(set(forward.inputs) - set(fwd_inputs), key=lambda t: t.name):
        fwd_inputs[tensor] = _input_like(tensor)
        expected.append(ExpectedConnection(tensor, ExpectedConnectionType.Fwd))
    return fwd_inputs, grad_inputs, expected


def recompute_graph(grad_graph: GraphWithNamedArgs) -> GraphWithNamedArgs:
    """``grad_graph`` (made by autodiff) as a graph that recomputes the forward first.

    Steps: 1. add inputs for the gradients and for every forward input; 2. call the
    forward graph on them; 3. call the gradient graph with the gradients, the
    recomputed activations, and new inputs for its other inputs (accumulators:
    by reference when the gradient graph's are); 4. output its outputs.

    Returns:
        The new gradient graph, whose ``grad_graph_info`` expects forward inputs (not
        activations) and whose ``args`` are ``grad_graph``'s mapped to the new inputs.
    """
    info = grad_graph.grad_graph_info
    ir = grad_graph.graph.ir
    r_graph = ir.create_empty_graph(f"{grad_graph.graph.base_name}_recomp")
    with r_graph:
        fwd_inputs, grad_inputs, expected = add_recompute_inputs(info)
        fwd_call = BoundGraph(info.forward_graph, fwd_inputs).call_with_info()
        grad_inputs.update(info.inputs_dict(fwd_call))
        for tensor in sorted(set(grad_graph.graph.inputs) - set(grad_inputs), key=lambda t: t.name):
            grad_inputs[tensor] = _input_like(tensor, by_ref=bool(tensor.node.meta.get(BY_REF)))
        for output in BoundGraph(grad_graph.graph, grad_inputs).call_with_info().outputs:
            graph_output(output)
    r_info = GradGraphInfo(r_graph, info.forward_graph, expected, info.expected_outputs)
    args = NamedTensors.from_dict({k: grad_inputs[t] for k, t in grad_graph.args.to_dict().items()})
    return GraphWithNamedArgs(r_graph, args, r_info)
