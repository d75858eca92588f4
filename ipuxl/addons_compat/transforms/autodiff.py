"""popxl.addons' autodiff transforms: ``autodiff`` and ``autodiff_with_accumulation``.

As upstream, the gradient graphs they make have PopART's default pre-alias patterns
applied (``popxl_addons.patterns``): a tensor-parallel all-reduce whose gradient is an
identity is one in the gradient graph at once, while the forward graph keeps its ops
until ``apply_pre_alias_patterns(ir)``.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Iterable, Mapping

import numpy as np

from ipuxl import transforms
from ipuxl.addons_compat.dot_tree import sanitise
from ipuxl.addons_compat.graph import GraphWithNamedArgs
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.ir.graph import Graph
from ipuxl.passes.op_to_identity import replace_ops_by_identity
from ipuxl.addons_compat.variable_factory import NamedVariableFactories, VariableFactory, add_variable_input
from ipuxl.errors import AutodiffError
from ipuxl.ir.context import in_sequence
from ipuxl.ir.grad_info import GradGraphInfo
from ipuxl.ir.graph_builder import constant
from ipuxl.ir.tensor import Tensor
from ipuxl.ops import var_updates

__all__ = ["autodiff", "autodiff_with_accumulation", "transform_autodiff"]


def _autodiff_with_patterns(graph: Graph, grads_provided: Iterable[Tensor] | None = None,
                            grads_required: Iterable[Tensor] | None = None,
                            called_graphs_grad_info: Mapping[Graph, GradGraphInfo] | None = None) -> GradGraphInfo:
    """``transforms.autodiff``, then the default pre-alias patterns on every grad graph it made."""
    infos = transforms.autodiff(graph, grads_provided=grads_provided, grads_required=grads_required,
                                called_graphs_grad_info=called_graphs_grad_info, return_all_grad_graphs=True)
    for info in infos.values():
        replace_ops_by_identity(info.graph)
    return infos[graph]


def autodiff(graph: GraphWithNamedArgs, grads_provided: Iterable[Tensor] | None = None,
             grads_required: Iterable[Tensor] | None = None,
             called_graphs_grad_info: Mapping[Graph, GradGraphInfo] | None = None) -> GraphWithNamedArgs:
    """The gradient graph of ``graph``, wrapped with its ``grad_graph_info``.

    See ``ipuxl.transforms.autodiff``: the forward graph gains outputs for the
    activations the gradient graph needs. A graph made by a Module that implements
    ``build_grad`` gets that hand-written gradient instead (``Module.create_grad_graph``).
    ``called_graphs_grad_info`` is accepted as upstream; called graphs are differentiated
    once, in place, whatever it holds (see ``ipuxl.transforms.autodiff``).
    """
    module = graph.from_module
    if module is not None and module.implements_grad_graph:
        return module.create_grad_graph(graph, grads_provided, grads_required)
    return transform_autodiff(graph, grads_provided, grads_required,
                              {**graph.called_graphs_grad_info, **(called_graphs_grad_info or {})})


def transform_autodiff(graph: GraphWithNamedArgs, grads_provided: Iterable[Tensor] | None,
                       grads_required: Iterable[Tensor] | None,
                       called_graphs_grad_info: Mapping[Graph, GradGraphInfo]) -> GraphWithNamedArgs:
    """The autodiff transform's gradient graph of ``graph`` (never its module's ``build_grad``)."""
    info = _autodiff_with_patterns(graph.graph, grads_provided, grads_required, called_graphs_grad_info)
    return GraphWithNamedArgs.from_grad_graph(info)


def autodiff_with_accumulation(graph: GraphWithNamedArgs, tensors_to_accumulate_grads: Iterable[Tensor],
                               grads_required: Iterable[Tensor] | None = None,
                               called_graphs_grad_info: Mapping[Graph, GradGraphInfo] | None = None,
                               replica_groupings: Any = None) -> tuple[NamedVariableFactories, GraphWithNamedArgs]:
    """Autodiff, then accumulate a running mean of some gradients in by-reference inputs.

    For each forward input in ``tensors_to_accumulate_grads`` the gradient graph gets
    an input ``accum.<name>`` (passed by reference) updated with
    ``accumulate_mean_(accum, grad, mean_accum_counter)`` instead of outputting the
    gradient; ``mean_accum_counter`` counts calls (reset it to restart the mean).

    Args:
        replica_groupings: a ``NamedReplicaGrouping`` by the forward inputs' names: an
            accumulator of a named input gets its grouping (a sharded weight's gradient
            is sharded as the weight); others are the same on all replicas.

    Returns:
        The factories of the accumulators and counter, and the gradient graph.
    """
    to_accumulate = list(tensors_to_accumulate_grads)
    required = list(grads_required or []) + [t for t in to_accumulate if t not in (grads_required or [])]
    groupings = replica_groupings.to_dict() if replica_groupings is not None else {}
    info = _autodiff_with_patterns(graph.graph, grads_required=required,
                                   called_graphs_grad_info=called_graphs_grad_info)
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
            arg_name = names.get(tensor, sanitise(tensor.name))
            name = "accum." + arg_name
            accum, factories[name] = add_variable_input(
                name, partial(np.zeros, tensor.shape, np.float32), tensor.dtype, by_ref=True,
                replica_grouping=groupings.get(arg_name))
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
