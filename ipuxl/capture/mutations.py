"""In-place writes of a captured forward, made into extra outputs.

A module is traced under ``torch.func.functionalize``, which computes every in-place
update functionally and ends the graph with ``copy_(dst, new)`` for each input it
wrote (BatchNorm's running statistics, a tensor argument changed in place). The
captured program must be a pure function, so ``extract_mutations`` removes those
copies and returns the new values as outputs instead; the caller writes them back.

A ``copy_`` into a tensor the forward made (``h.copy_(v)``, ``Tensor.uniform_``,
in-place ``rrelu``...) stays in the graph as the functional ``aten.copy``, which has
no derivative: ``differentiable_copies`` rewrites each into ops autodiff can
differentiate (``v`` itself, or ``fill(h, -0.0) + v``), with the same values.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from ipuxl.capture.nodes import output_nodes, placeholders

__all__ = ["extract_mutations", "differentiable_copies", "traced_call"]

_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack")  # where the user's code made a node


def extract_mutations(gm: fx.GraphModule, n_inputs: int, state_names: list[str]) -> tuple[list[str], list[int]]:
    """Turn functionalize's trailing ``copy_(dst, new)`` into extra outputs of ``gm`` (in place).

    Args:
        gm: the traced graph; its placeholders are the call's ``n_inputs`` tensor
            inputs, then the parameters and buffers named ``state_names``.

    Returns:
        The mutated parameter/buffer names (their new values follow the user's
        outputs, in this order) and the positions of the call's own tensor inputs
        written in place (their new values come last, so the caller's tensors can be
        updated).

    The copies left inside the graph are then made differentiable (``differentiable_copies``).
    """
    inputs = placeholders(gm.graph)
    state_nodes = {node: state_names[i] for i, node in enumerate(inputs[n_inputs:n_inputs + len(state_names)])}
    input_nodes = {node: i for i, node in enumerate(inputs[:n_inputs])}
    outs: list[fx.Node] = output_nodes(gm.graph)
    mutated, input_news = [], {}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default:
            dst, src = node.args
            assert isinstance(src, fx.Node), node.format_node()
            if dst in state_nodes:
                mutated.append(state_nodes[dst])
                outs.append(src)
                gm.graph.erase_node(node)
            elif dst in input_nodes:
                input_news[input_nodes[dst]] = src
                gm.graph.erase_node(node)
    mutated_inputs = sorted(input_news)
    outs.extend(input_news[i] for i in mutated_inputs)
    gm.graph.output_node().args = (outs,)
    differentiable_copies(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return mutated, mutated_inputs


def differentiable_copies(gm: fx.GraphModule) -> None:
    """Replace each functional ``aten.copy(dst, src)`` of ``gm`` (in place) by ``src`` when it
    already has ``dst``'s shape, dtype and strides, else by ``fill(dst, -0.0) + src.to(dst.dtype)``
    (``-0.0 + v`` is ``v``, signed zeros included): ``dst``'s layout, ``src``'s values,
    broadcast and cast, and the gradients of ``copy_`` (all to ``src``, none to ``dst``).
    Call ``gm.recompile()`` afterwards."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy.default:
            continue
        dst, src = node.args[:2]
        assert isinstance(dst, fx.Node) and isinstance(src, fx.Node), node.format_node()
        want, have = node.meta["val"], src.meta["val"]
        if (want.shape, want.dtype, want.stride()) == (have.shape, have.dtype, have.stride()):
            node.replace_all_uses_with(src)
        else:
            with graph.inserting_before(node):
                value = src if have.dtype == want.dtype else traced_call(
                    graph, node, torch.ops.aten._to_copy.default, (src,), {"dtype": want.dtype})
                zeros = traced_call(graph, node, torch.ops.aten.fill.Scalar, (dst, -0.0), {})
                node.replace_all_uses_with(traced_call(graph, node, torch.ops.aten.add.Tensor, (zeros, value), {}))
        graph.erase_node(node)


def traced_call(graph: fx.Graph, like: fx.Node, target: Callable, args: tuple, kwargs: dict) -> fx.Node:
    """A new node ``target(*args, **kwargs)`` with ``like``'s source location and a value meta
    computed by running ``target`` on the arguments' meta values (fake tensors)."""
    node = graph.call_function(target, args, kwargs)
    node.meta.update({k: v for k, v in like.meta.items() if k in _KEPT_META})
    node.meta["val"] = target(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args), **kwargs)
    return node
