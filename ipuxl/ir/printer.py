"""Text form of a graph's schedule (``Graph.print_schedule``), as PopXL prints it::

    Graph : Linear_subgraph(0)
      (%1, weight=%2, bias=%3) -> (%5) {
        MatMul.100 (%1 [(2, 4) float32], %2 [(4, 32) float32]) -> (%4 [(2, 32) float32])
        Add.101 (%4 [(2, 32) float32], %3 [(32,) float32]) -> (%5 [(2, 32) float32])
      }

Tensors are numbered ``%1, %2...`` in order of appearance (inputs first); inputs
with a name in ``named`` print as ``name=%k``. Ops get PopART's type names and ids
(numbered across the IR from 100 in creation order); a call names the graph it calls.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Mapping, cast

import torch
import torch.fx as fx

from ipuxl.dtypes import dtype_name
from ipuxl.ir.meta import CALLED_GRAPH, OP, OP_ID, ROLE, STREAM, Role

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.tensor import Tensor

__all__ = ["format_schedule"]

# ipuxl op names and aten names (graphs rewritten by autodiff) -> PopART op types.
_OP_TYPES = {
    "add": "Add", "add_": "AddLhsInplace", "sub": "Sub", "mul": "Mul", "div": "Div", "negate": "Neg",
    "neg": "Neg", "pow": "Pow", "abs": "Abs", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "tanh": "Tanh",
    "sigmoid": "Sigmoid", "relu": "Relu", "gelu": "Gelu", "softmax": "Softmax", "_softmax": "Softmax",
    "log_softmax": "LogSoftmax", "matmul": "MatMul", "mm": "MatMul", "bmm": "MatMul", "addmm": "MatMul",
    "reshape": "Reshape", "view": "Reshape", "_unsafe_view": "Reshape", "flatten": "Flatten",
    "transpose": "Transpose", "t": "Transpose", "permute": "Transpose", "concat": "Concat", "cat": "Concat",
    "split": "Split", "slice": "Slice", "squeeze": "Squeeze", "unsqueeze": "Unsqueeze", "gather": "Gather",
    "sum": "ReduceSum", "mean": "ReduceMean", "max": "ReduceMax", "min": "ReduceMin", "argmax": "ArgMax",
    "argmin": "ArgMin", "cast": "Cast", "_to_copy": "Cast", "dropout": "Dropout", "random_normal": "RandomNormal",
    "random_uniform": "RandomUniform", "nll_loss": "Nll", "nll_loss_with_softmax_grad": "NllWithSoftmaxGrad",
    "scaled_add": "ScaledAdd", "scaled_add_": "ScaledAddLhsInplace", "accumulate_": "Accumulate",
    "copy_var_update_": "CopyVarUpdate", "accumulate_moving_average_": "Accumulate",
    "accumulate_moving_average_square_": "Accumulate", "accumulate_square_": "Accumulate",
    "accumulate_mean_": "Accumulate", "adam_updater": "AdamUpdater", "lamb_square": "LambSquare",
    "call": "Call", "repeat": "Loop", "host_load": "HostLoad", "host_store": "HostStore",
    "gelu_backward": "GeluGrad", "tanh_backward": "TanhGrad", "_softmax_backward_data": "SoftmaxGrad",
    "threshold_backward": "ReluGrad", "expand": "Expand", "clone": "Identity", "detach": "Detach",
    "replicated_all_reduce": "ReplicatedAllReduce", "replicated_all_reduce_": "ReplicatedAllReduceInplace",
    "replicated_reduce_scatter": "ReplicatedReduceScatter", "replicated_all_gather": "ReplicatedAllGather",
}


def format_schedule(graph: "Graph", named: Mapping["Tensor", str] | None = None) -> str:
    """Render ``graph`` in PopXL's schedule text (see the module docstring)."""
    ids: dict[fx.Node, str] = {}
    input_names = {t.node: name for t, name in (named or {}).items()}
    ins = ", ".join(_input(t.node, ids, input_names) for t in graph.inputs)
    lines = [f"Graph : {graph.name}", ""]
    op_id = 100
    for node in graph.fx.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.meta.get(OP) == "output_of" or (node.op == "call_function" and _is_item(node)):
            continue
        lines.append(f"    {_op_line(node, node.meta.get(OP_ID, op_id), ids)}")
        op_id += 1
    outs = ", ".join(_ref(t.node, ids) for t in graph.outputs)
    lines[1] = f"  ({ins}) -> ({outs}) {{"
    lines.append("  }")
    return "\n".join(lines)


def _input(node: fx.Node, ids: dict[fx.Node, str], names: Mapping[fx.Node, str]) -> str:
    ref = _ref(node, ids)
    return f"{names[node]}={ref}" if node in names else ref


def _ref(node: Any, ids: dict[Any, str]) -> str:
    if node not in ids:
        ids[node] = f"%{len(ids) + 1}"
    return ids[node]


def _op_line(node: fx.Node, op_id: int, ids: dict[fx.Node, str]) -> str:
    if node.meta.get(OP) == "host_load":
        return f"HostLoad.{op_id}({node.meta[STREAM].name}) () -> ({_typed(node, ids)})"
    name = node.meta.get(OP) or _target_name(node.target)
    op_type = _OP_TYPES.get(name, _pascal(name))
    called = node.meta.get(CALLED_GRAPH)  # read from meta: ir.calls imports ir.graph, which imports this module
    if called is not None:
        op_type = f"{op_type}.{op_id}({called.name})"
    elif name == "host_store":
        op_type = f"HostStore.{op_id}({cast(fx.Node, node.args[0]).meta[STREAM].name})"
    else:
        op_type = f"{op_type}.{op_id}"
    inputs = [a for a in _flat_args(node) if a.meta.get(ROLE) != Role.D2H]
    if name == "host_store":
        return f"{op_type} ({', '.join(_typed(a, ids) for a in inputs)}) -> ()"
    typed_inputs = ", ".join(_typed(a, ids) for a in inputs)
    items = {cast(int, u.args[1]): u for u in node.users if _is_item(u)}
    if called is not None:  # every output of the call, used or not
        outputs = [_typed(items.get(i, (node, i)), ids, out.node.meta.get("val"))
                   for i, out in enumerate(called.outputs)]
    else:
        outputs = [_typed(items[i], ids) for i in sorted(items)] if items else [_typed(node, ids)]
    return f"{op_type} ({typed_inputs}) -> ({', '.join(outputs)})"


def _typed(node: Any, ids: dict[Any, str], val: Any = None) -> str:
    if isinstance(node, fx.Node):
        val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{_ref(node, ids)} [{tuple(val.shape)} {dtype_name(val.dtype)}]"
    return _ref(node, ids)


def _is_item(node: fx.Node) -> bool:
    return node.target is operator.getitem and isinstance(node.args[0], fx.Node)


def _flat_args(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target)).split(".")[-1]


def _pascal(name: str) -> str:
    return "".join(part.capitalize() for part in name.strip("_").split("_")) or name
