"""popxl.addons' autodiff transforms: ``autodiff`` and ``autodiff_with_accumulation``."""
from __future__ import annotations

from functools import partial
from typing import Iterable

import numpy as np

from ipuxl import transforms
from ipuxl.addons_compat.dot_tree import sanitise
from ipuxl.addons_compat.graph import GraphWithNamedArgs
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.addons_compat.variable_factory import NamedVariableFactories, VariableFactory, add_variable_input
from ipuxl.errors import AutodiffError
from ipuxl.ir.context import in_sequence
from ipuxl.ir.grad_info import GradGraphInfo
from ipuxl.ir.graph_builder import constant
from ipuxl.ir.tensor import Tensor
from ipuxl.ops import var_updates

__all__ = ["autodiff", "autodiff_with_accumulation"]


def autodiff(graph: GraphWithNamedArgs, grads_provided: Iterable[Tensor] | None = None,
             grads_required: Iterable[Tensor] | None = None) -> GraphWithNamedArgs:
    """The gradient graph of ``graph``, wrapped with its ``grad_graph_info``.

    See ``ipuxl.transforms.autodiff``: the forward graph gains outputs for the
    activations the gradient graph needs. A graph made by a Module that implements
    ``build_grad`` gets that hand-written gradient instead (``Module.create_grad_graph``).
    """
    module = graph.from_module
    if module is not None and module.implements_grad_graph:
        return module.create_grad_graph(graph, grads_provided, grads_required)
    info = transforms.autodiff(graph.graph, grads_provided=grads_provided, grads_required=grads_required)
    return GraphWithNamedArgs.from_grad_graph(info)


def autodiff_with_accumulation(graph: GraphWithNamedArgs, tensors_to_accumulate_grads: Iterable[Tensor],
                               grads_required: Iterable[Tensor] | None = None,
                               replica_groupings: object = None) -> tuple[NamedVariableFactories, GraphWithNamedArgs]:
    """Autodiff, then accumulate a running mean of some gradients in by-reference inputs.

    For each forward input in ``tensors_to_accumulate_grads`` the gradient graph gets
    an input ``accum.<name>`` (passed by reference) updated with
    ``accumulate_mean_(accum, grad, mean_accum_counter)`` instead of outputting the
    gradient; ``mean_accum_counter`` counts calls (reset it to restart the mean).

    Returns:
        The factories of the accumulators and counter, and the gradient graph.
    """
    to_accumulate = list(tensors_to_accumulate_grads)
    required = list(grads_required or []) + [t for t in to_accumulate if t not in (grads_required or [])]
    info = transforms.autodiff(graph.graph, grads_required=required)
    names = {t: name for name, t in graph.args.named_tensors.items()}
    grad_graph = info.graph
    inputs: dict[str, Tensor] = {}
    factories: dict[str, VariableFactory] = {}
    with grad_graph, in_sequence(True):
        counter, factories["mean_accum_counter"] = add_variable_input(
            "mean_accum_counter", lambda: np.zeros((), np.float32), by_ref=True)
        inputs["mean_accum_counter"] = counter
        removed = []
        for tensor in to_accumulate:
            index = next((i for i, t in enumerate(info.outputs) if t is tensor), None)
            if index is None:
                raise AutodiffError(f"'{tensor.name}' is not an input of graph '{graph.graph.name}'",
                                    fix="accumulate gradients of the forward graph's inputs")
            name = "accum." + names.get(tensor, sanitise(tensor.name))
            accum, factories[name] = add_variable_input(
                name, partial(np.zeros, tensor.shape, np.float32), tensor.dtype, by_ref=True)
            inputs[name] = accum
            var_updates.accumulate_mean_(accum, grad_graph.outputs[index], counter)
            removed.append(index)
        var_updates.accumulate_(counter, constant(1.0, name="one"))
    keep = [i for i in range(len(grad_graph.outputs)) if i not in removed]
    grad_graph.set_outputs([grad_graph.outputs[i] for i in keep])
    new_info = GradGraphInfo(grad_graph, info.forward_graph, list(info.expected_inputs),
                             [info.expected_outputs[i] for i in keep])
    return (NamedVariableFactories.from_dict(factories),
            GraphWithNamedArgs.from_grad_graph(new_info, NamedTensors.from_dict(inputs)))
