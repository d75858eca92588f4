"""Autodiff, steps 1b-5: from the traced joint graph to the forward and grad IR graphs.

The autodiff pass (``ipuxl.passes.autodiff``, whose module docstring numbers the
steps) traces the joint forward-and-backward function of a graph with ``make_fx``;
this module holds what is done with that joint graph:

* ``check_gradient_paths`` (1b): an explicitly required gradient must depend on a tangent;
* ``tag_forward`` and ``recompute_input_views`` (2): tag every node forward or
  backward for functorch's ``default_partition`` (which the pass then runs, step 3);
* ``rewrite_forward`` (4): the partitioned forward becomes the forward graph's body,
  the activations the backward needs its new outputs;
* ``build_grad_graph`` (5): the partitioned backward becomes the grad IR graph.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Sequence, cast

import torch
import torch.fx as fx

from ipuxl.errors import AutodiffError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.fx_import import copy_fx_body, returns_view
from ipuxl.ir.graph import Graph
from ipuxl.ir.meta import NAME, OP
from ipuxl.ir.tensor import Tensor, keep_layout
from ipuxl.kernels import tp_collectives

__all__ = ["FWD_TAG", "BWD_TAG", "check_gradient_paths", "tag_forward", "recompute_input_views",
           "rewrite_forward", "build_grad_graph", "output_args"]

FWD_TAG, BWD_TAG = "is_forward", "is_backward"


def output_args(graph: fx.Graph) -> list[Any]:
    """The values an fx graph returns (its output node's tuple)."""
    return list(cast(Sequence[Any], graph.output_node().args[0]))



def check_gradient_paths(graph: Graph, joint: fx.GraphModule, n_fwd: int, required: list[Tensor],
                         explicit: bool) -> None:
    """Raise when an explicitly required gradient does not depend on any provided gradient."""
    if not explicit:
        return
    grads = output_args(joint.graph)[n_fwd:]
    reached = _tangent_dependent(joint)
    for t, grad in zip(required, grads):
        if grad not in reached:
            raise AutodiffError(
                f"autodiff of graph '{graph.name}': input '{t.name}' has no differentiable path to the "
                "outputs in grads_provided (its gradient would always be zero)", where=user_source_line(),
                fix="remove it from grads_required, or check that the outputs use it (ops.detach stops gradients)")


def _tangent_dependent(joint: fx.GraphModule) -> set[fx.Node]:
    """Nodes that depend on a tangent input (one pass in program order)."""
    reached: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


# -- step 2: tags -----------------------------------------------------------------------------------
def tag_forward(joint: fx.GraphModule, n_fwd: int) -> None:
    forward_nodes: set[fx.Node] = set()
    stack = [n for n in output_args(joint.graph)[:n_fwd] if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in forward_nodes:
            forward_nodes.add(node)
            stack.extend(node.all_input_nodes)
    # Every result of a forward op with several results is forward too (nll_loss_forward's
    # total_weight, max_pool's indices...): tagged backward, a result the backward reads
    # would make the partitioner run the whole op again in the backward.
    for node in list(forward_nodes):
        if node.users and all(user.op == "call_function" and user.target is operator.getitem
                              for user in node.users):
            forward_nodes.update(node.users)
    for node in joint.graph.nodes:
        if node.op in ("call_function", "get_attr"):
            node.meta["partitioner_tag"] = FWD_TAG if node in forward_nodes else BWD_TAG


def recompute_input_views(joint: fx.GraphModule) -> None:
    """Views of the graph's inputs that the backward reads (``t(weight)``, a permuted
    input...) are recomputed in the backward from the input, which is saved instead.
    Saved as they are, they would be forward outputs sharing an input's storage, which
    a call copies (its outputs are new tensors): a copy of every transposed weight per
    step. Each such view chain gets a copy tagged backward, placed before the first
    backward reader (the partitioner keeps the graph's order), read by the backward."""
    graph = joint.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    readers = {node: [u for u in node.users if u.meta.get("partitioner_tag") == BWD_TAG]
               for node in graph.nodes
               if node.meta.get("partitioner_tag") == FWD_TAG and returns_view(node.target) and _input_view(node)}
    readers = {node: users for node, users in readers.items() if users}
    if not readers:
        return
    anchor = min((u for users in readers.values() for u in users), key=order.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}

    def backward_copy(node: fx.Node) -> fx.Node:
        if node.op == "placeholder":
            return node
        if node not in copies:
            source = backward_copy(cast(fx.Node, node.args[0]))
            with graph.inserting_before(anchor):
                copy = graph.call_function(cast(Callable[..., Any], node.target), (source, *node.args[1:]),
                                           dict(node.kwargs))
            copy.meta.update(node.meta)
            copy.meta["partitioner_tag"] = BWD_TAG
            copies[node] = copy
        return copies[node]

    for node, users in readers.items():
        copy = backward_copy(node)
        for user in users:
            user.replace_input_with(node, copy)


def _input_view(node: fx.Node) -> bool:
    """Whether ``node`` is a chain of views of a placeholder."""
    while node.op == "call_function" and returns_view(node.target) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.op == "placeholder"


# -- step 4: forward rewrite --------------------------------------------------------------------------
def rewrite_forward(graph: Graph, fw: fx.GraphModule, n_fwd: int) -> list[tuple[str, Tensor]]:
    """Replace ``graph``'s body by the partitioned forward; return (saved name, fwd tensor) pairs."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    node_map: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    for node, handle in zip(placeholders, graph.inputs):
        fresh = new.placeholder(handle.node.name)
        fresh.meta.update(handle.node.meta)
        env[node] = node_map[handle.node] = fresh
    copy_fx_body(fw, new, env, graph.constant_data, graph.ir, replaces=graph.fx)
    _tag_traced_collectives(new)
    _reshape_views(new)
    outputs = output_args(fw.graph)
    for handle, node in zip(graph.outputs, outputs[:n_fwd]):
        node_map.setdefault(handle.node, env[node])  # an input returned as it is is mapped already
    graph.replace_body(new, node_map)
    return [(node.name, _saved_tensor(graph, env[node])) for node in outputs[n_fwd:]]


def _tag_traced_collectives(fx_graph: fx.Graph) -> None:
    """Mark traced collectives (all-gathers, TP all-reduces) as the collectives they are (the
    passes and the replica plan find collectives by ``OP``); their arguments keep the order
    of the ops that built them."""
    for node in fx_graph.nodes:
        if node.target in (torch.ops.ipuxl.all_gather, torch.ops.ipuxl.all_gather.default):
            node.meta[OP] = "replicated_all_gather"
        elif node.target in tp_collectives.TP_ALL_REDUCE_TARGETS:
            node.meta[OP] = "replicated_all_reduce_TP"


def _reshape_views(fx_graph: fx.Graph) -> None:
    """Make traced ``view`` ops ``reshape`` ops.

    A PopXL caller may pass a graph a non-contiguous tensor (a slice of a transpose)
    where the trace saw a contiguous one, and ``view`` fails on it; ``reshape`` is the
    same view when the strides allow one and a copy otherwise, which the graph's value
    semantics (no in-place writes after functionalization) cannot tell apart.
    """
    for node in fx_graph.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default


def _saved_tensor(graph: Graph, node: fx.Node) -> Tensor:
    """The forward tensor of saved activation ``node``: an input or output, else a new output."""
    existing = graph.handle(node)
    if existing is not None:
        return existing
    tensor = graph.wrap(node)
    node.meta.setdefault(NAME, node.name)
    graph.add_output(tensor)
    return tensor


# -- step 5: grad graph -------------------------------------------------------------------------------
def build_grad_graph(graph: Graph, bw: fx.GraphModule, provided: list[Tensor],
                      saved: list[tuple[str, Tensor]], required: list[Tensor]) -> Graph:
    grad = graph.ir.new_subgraph(f"{graph.base_name}_grad")
    placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    env: dict[fx.Node, fx.Node] = {}
    for k, t in enumerate(provided, start=1):
        handle = grad.add_input(t.spec, f"Gradient___{t.name}")
        if f"tangents_{k}" in placeholders:
            env[placeholders[f"tangents_{k}"]] = handle.node
    for name, t in saved:
        handle = grad.add_input(t.spec, t.name)
        keep_layout(handle.node, placeholders[name].meta["val"])  # a transpose saved stays one: no copy per call
        env[placeholders[name]] = handle.node
    copy_fx_body(bw, grad.fx, env, grad.constant_data, graph.ir)
    _tag_traced_collectives(grad.fx)
    _reshape_views(grad.fx)
    outputs = []
    for node, fwd_input in zip(output_args(bw.graph), required):
        out = env[node]
        if out.op != "placeholder":  # an input passed through keeps its own name
            out.meta[NAME] = f"Gradient___{fwd_input.name}"
        outputs.append(grad.wrap(out))
    grad.set_outputs(outputs)
    return grad
