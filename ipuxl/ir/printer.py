"""Text form of a graph's schedule (``Graph.print_schedule``).

PopXL itself has no text dump of a graph; this follows the shape of PopART's
schedule logs: a header with inputs and outputs, then one line per op in schedule
order, ``op_name (inputs) -> (outputs)``, with called graphs named.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from ipuxl.dtypes import dtype_name

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph


def format_schedule(graph: "Graph") -> str:
    ins = ", ".join(_name(t.node) for t in graph.inputs)
    outs = ", ".join(_name(t.node) for t in graph.outputs)
    lines = [f"Graph : {graph.name}", f"  ({ins}) -> ({outs}) {{"]
    for node in graph.fx.nodes:
        if node.op == "placeholder" and node.meta.get("ipuxl_role", "input") in ("input", "d2h"):
            continue
        if node.op == "get_attr" or node.meta.get("ipuxl_op") == "output_of":
            continue
        lines.append(f"    {_op_line(node)}")
    lines.append("  }")
    return "\n".join(lines)


def _op_line(node: fx.Node) -> str:
    if node.op == "placeholder":
        stream = node.meta.get("ipuxl_stream")
        return f"host_load({stream.name}) -> ({_name(node)} {_spec(node)})"
    if node.meta.get("ipuxl_op") == "host_store":
        stream = node.args[0].meta["ipuxl_stream"]
        return f"host_store({stream.name}) ({_name(node.args[1])})"
    op = node.meta.get("ipuxl_op") or _target_name(node.target)
    called = node.meta.get("ipuxl_called_graph")
    if called is not None:
        op = f"{op}({called.name})"
    args = ", ".join(_name(a) for a in _flat_args(node))
    users = [u for u in node.users if u.meta.get("ipuxl_op") == "output_of"]
    outs = ", ".join(f"{_name(u)} {_spec(u)}" for u in users) if users else f"{_name(node)} {_spec(node)}"
    return f"{op} ({args}) -> ({outs})"


def _flat_args(node: fx.Node) -> list[Any]:
    found: list[Any] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _name(node: Any) -> str:
    return node.meta.get("ipuxl_name", node.name) if isinstance(node, fx.Node) else repr(node)


def _spec(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"[{dtype_name(val.dtype)} {tuple(val.shape)}]"
    return ""


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target)).split(".")[-1]
