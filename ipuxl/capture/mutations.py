"""In-place writes of a captured forward, made into extra outputs.

A module is traced under ``torch.func.functionalize``, which computes every in-place
update functionally and ends the graph with ``copy_(dst, new)`` for each input it
wrote (BatchNorm's running statistics, a tensor argument changed in place). The
captured program must be a pure function, so ``extract_mutations`` removes those
copies and returns the new values as outputs instead; the caller writes them back.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ipuxl.capture.nodes import output_nodes, placeholders

__all__ = ["extract_mutations"]


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
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return mutated, mutated_inputs
