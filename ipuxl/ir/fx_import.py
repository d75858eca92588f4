"""Import the body of a make_fx (aten-level) GraphModule into an IR graph.

Used by ``transforms.autodiff`` (the partitioned forward and backward) and by module
capture (``capture.trace``): each node is copied with a meta tensor value, a fresh op
id and, for aten ops that return a view of their input, the ``ipuxl_view_of`` record
that lowering needs to keep PopXL's value semantics. ``ipuxl::call_graph`` nodes (calls
of shared graphs recorded while tracing, see ``ir.call_op``) become IR calls.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ipuxl.ir.call_op import call_entry, is_call_graph_node
from ipuxl.ir.lower import CallTarget

__all__ = ["copy_fx_body", "to_meta"]


def copy_fx_body(source: fx.GraphModule, new: fx.Graph, env: dict[fx.Node, fx.Node],
                 constants: dict[str, torch.Tensor], ir: Any) -> None:
    """Copy every op of ``source`` into ``new``; ``env`` maps source nodes (placeholders
    already bound) to new nodes and is filled in; constants land in ``constants``."""
    calls: dict[fx.Node, Any] = {}
    for node in source.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_call_graph_node(node):
            env[node] = calls[node] = _import_call(node, new, env, ir)
            continue
        copied = new.node_copy(node, lambda n: env[n])
        if node.target is operator.getitem and node.args[0] in calls:
            out = calls[node.args[0]].meta["ipuxl_called_graph"].outputs[node.args[1]]
            copied.meta.update(ipuxl_op="output_of", ipuxl_name=out.name)
        copied.meta["val"] = to_meta(node.meta.get("val"))
        if node.op == "call_function" and node.target is not operator.getitem:
            copied.meta["ipuxl_op_id"] = ir._next_op_id()
        if _returns_view(node.target) and copied.all_input_nodes:
            copied.meta["ipuxl_view_of"] = copied.all_input_nodes[0]
        if node.op == "get_attr":
            constants[node.target] = getattr(source, node.target)
        env[node] = copied


def _import_call(node: fx.Node, new: fx.Graph, env: dict[fx.Node, fx.Node], ir: Any) -> fx.Node:
    """An IR call of the graph behind an ``ipuxl::call_graph`` node."""
    key, args = node.args
    graph = call_entry(key).graph
    target = CallTarget(graph)
    call = new.create_node("call_function", target, tuple(env[a] for a in args), {}, name=target.__name__)
    call.meta.update(val=to_meta(tuple(node.meta["val"])), ipuxl_op="call", ipuxl_called_graph=graph,
                     ipuxl_op_id=ir._next_op_id())
    return call


def _returns_view(target: Any) -> bool:
    """True for aten ops whose result aliases their first input (view, t, expand...)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(to_meta(v) for v in value)
    return value
