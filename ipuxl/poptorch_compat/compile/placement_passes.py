"""Placement passes: after capture, the rest of a PopTorch program takes its stages and IPUs.

``compile.placement`` gives the traced forward's ops their stage and IPU. Then, on the IR:

* ``place_gradients``: each op of the grad graph runs on the IPU of the forward stage it
  differentiates, in that stage's backward pipeline stage;
* ``place_variables``: each parameter and buffer variable lives on the IPU of the first
  op that reads it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from ipuxl.ir.meta import IPU, PIPELINE_STAGE

if TYPE_CHECKING:
    from ipuxl.ir.grad_info import GradGraphInfo
    from ipuxl.ir.graph import Graph
    from ipuxl.poptorch_compat.compile.placement import StagePlan
    from ipuxl.poptorch_compat.compile.program import Program

__all__ = ["place_gradients", "place_variables"]


def place_gradients(info: GradGraphInfo, plan: StagePlan) -> None:
    """Place the grad graph's ops: each runs on the IPU of the forward stage it
    differentiates, in that stage's backward pipeline stage (``2 * N - 2 - s`` for
    forward stage ``s``, as PopART numbers them).

    1. Each grad-graph input takes the stage of the forward tensor it connects to.
    2. In program order, an op takes the lowest forward stage among its inputs (the
       gradient flowing back from stage ``s + 1`` meets stage ``s``'s activations).
    3. Ops that read nothing placed (constants) take the stage of their first reader.
    """
    forward_stage: dict[fx.Node, int] = {}
    for grad_input, connection in zip(info.graph.inputs, info.expected_inputs):
        stage = connection.fwd_tensor.node.meta.get(PIPELINE_STAGE)
        if stage is not None:
            forward_stage[grad_input.node] = stage
    unplaced = []
    for node in info.graph.fx.nodes:
        if node.op in ("placeholder", "output"):
            continue
        stages = [forward_stage[n] for n in node.all_input_nodes if n in forward_stage]
        if stages:
            forward_stage[node] = min(stages)
        else:
            unplaced.append(node)
    for node in reversed(unplaced):
        readers = [forward_stage[u] for u in node.users if u in forward_stage]
        if readers:
            forward_stage[node] = min(readers)
    _place_weight_gradients(info, forward_stage)
    last = 2 * plan.num_stages - 2
    for node, stage in forward_stage.items():
        if node.op != "placeholder":
            node.meta[IPU], node.meta[PIPELINE_STAGE] = plan.ipus[stage], last - stage


def _place_weight_gradients(info: GradGraphInfo, forward_stage: dict[fx.Node, int]) -> None:
    """4. The ops that only compute a parameter's gradient run in the stage of the
    parameter's first reader, even when they read an activation of an earlier stage."""
    for result, connection in zip(info.graph.outputs, info.expected_outputs):
        readers = [u.meta[PIPELINE_STAGE] for u in connection.fwd_tensor.node.users if PIPELINE_STAGE in u.meta]
        if not readers:
            continue
        owned: set[fx.Node] = set()
        stack = [result.node]
        while stack:
            node = stack.pop()
            if node.op == "placeholder" or node in owned or any(
                    u not in owned and u.op != "output" for u in node.users):
                continue
            owned.add(node)
            forward_stage[node] = min(readers)
            stack.extend(node.all_input_nodes)


def place_variables(program: Program, forward: Graph) -> None:
    """Put each parameter and buffer variable on the IPU of the first op that reads it."""
    traced = program.traced
    n_in = len(traced.input_names)
    names = traced.params + traced.buffers
    held = {**program.params, **program.buffers}
    order = {node: i for i, node in enumerate(forward.fx.nodes)}
    for name, forward_input in zip(names, forward.inputs[n_in:n_in + len(names)]):
        readers = [u for u in forward_input.node.users if IPU in u.meta]
        if readers and name in held:
            held[name].node.meta[IPU] = min(readers, key=order.__getitem__).meta[IPU]
