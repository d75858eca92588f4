"""Import a captured module (``TracedModule``) into the IR as a subgraph.

The subgraph's inputs are the call's tensor inputs, the parameters, the buffers and,
when the module draws random numbers, its seed (the traced placeholder whose
``ROLE`` is ``Role.SEED``); its outputs are the user's output leaves, then the new
values of the parameters/buffers and inputs it wrote. The result is ready for
``transforms.autodiff`` and ``ops.call``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ipuxl.capture.nodes import output_nodes, placeholders, spec_of
from ipuxl.capture.trace import TracedModule
from ipuxl.ir.fx_import import copy_fx_body
from ipuxl.ir.graph import Graph
from ipuxl.ir.ir import Ir
from ipuxl.ir.meta import NAME, NO_GRAD, ROLE, Role
from ipuxl.ir.tensor import keep_layout

__all__ = ["graph_from_trace"]

_SEED_NAME = "seed"  # the IR name of a module's seed input (its role says what it is, not this name)


def graph_from_trace(ir: Ir, traced: TracedModule, needs_grad: list[bool] | None = None, *,
                     layouts: bool = False) -> Graph:
    """A new subgraph of ``ir`` computing ``traced`` (see the module docstring).

    Each outlined block becomes one subgraph of its own, called from every place it ran.
    ``needs_grad`` (per input before the seed): False marks an input no call passes a
    value needing a gradient (``ir.meta.NO_GRAD``); autodiff then leaves it out.
    ``layouts``: the inputs keep the strides they were traced with (a block is traced on
    its first run's layouts, a transpose's for Gemma 3's ``q_norm``; its callers' traced
    views rely on the outputs those layouts give), else they are contiguous.
    """
    for block in traced.blocks:
        block.entry.graph = graph_from_trace(ir, block.traced, block.needs_grad, layouts=True)
    graph = ir.new_subgraph(traced.name)
    env = _bind_inputs(graph, traced, needs_grad, layouts)
    copy_fx_body(traced.gm, graph.fx, env, graph.constant_data, ir)
    out_names = ([f"output{i}" for i in range(traced.n_outputs)] + [f"{m}.new" for m in traced.mutated]
                 + [f"{traced.input_names[i]}.new" for i in traced.mutated_inputs])
    outputs = []
    for node, out_name in zip(output_nodes(traced.gm.graph), out_names):
        new = env[node]
        if new.op != "placeholder":
            new.meta[NAME] = out_name
        outputs.append(graph.wrap(new))
    graph.set_outputs(outputs)
    return graph


def _bind_inputs(graph: Graph, traced: TracedModule, needs_grad: list[bool] | None,
                 layouts: bool) -> dict[fx.Node, fx.Node]:
    """Add ``graph``'s inputs for the traced placeholders; the seed only when it is used."""
    names = iter(traced.input_names + traced.params + traced.buffers)
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(placeholders(traced.gm.graph)):
        if node.meta.get(ROLE) == Role.SEED:
            if not traced.uses_seed:
                continue
            name = _SEED_NAME
        else:
            name = next(names)
        env[node] = graph.add_input(spec_of(node), name).node
        if layouts and isinstance(node.meta.get("val"), torch.Tensor):
            keep_layout(env[node], node.meta["val"])
        if needs_grad is not None and i < len(needs_grad) and not needs_grad[i]:
            env[node].meta[NO_GRAD] = True
    return env
