"""``PoplarExecutor._debugGetPopartIR``: a compiled program as a PopART IR dump.

Upstream returns PopART's IR of the compiled model as JSON: ``{"maingraph": [op, ...]}``
(other graphs by name when PopART outlined some), each op ``{"type", "name",
"inputs": [{"name", "type", "shape"}], "outputs": [...], "attributes": {}}``; tests
and tools count op types in it. ipuxl has no PopART IR. Its dump lists the ops
ipuxl runs for one device iteration, in the order they run, under PopART's names for
them:

* every call of a subgraph (the forward, its grad graph, an outlined block, the
  device loop's body) is expanded where it is called, so there is one ``maingraph``;
* an aten or PopXL op takes PopART's op type (``aten.addmm`` / ``aten.mm`` ->
  ``MatMul``, ``aten.convolution`` -> ``Conv``, ``_log_softmax`` -> ``LogSoftmax``,
  ``_to_copy`` -> ``Cast``, ``view`` -> ``Reshape``, ``adam_updater`` ->
  ``AdamUpdater``...; a backward kernel ``<op>_backward`` -> ``<Op>Grad``); an op
  PopART has no name for keeps its own name in CamelCase;
* the last update of each trained weight is the optimiser's var update, with
  PopART's type for the optimiser: ``SGD0VarUpdate`` (SGD without momentum),
  ``SGD1VarUpdate`` / ``SGD2VarUpdate`` (with momentum, combined or separate
  accumulator), ``AdamVarUpdate`` (Adam, AdamW, LAMB, RMSprop);
* host transfers are not ops (PopART streams them outside its graph), nor are
  tuple accesses;
* tensors are named as ipuxl names them, a training model's parameters as upstream
  (``model.<path>``); ops' ``attributes`` are empty and their names are
  ``<Type>:<n>``, ``n`` counting from 0 in the order they run (ipuxl records no
  module name scopes).

So op-type counts that reflect what the model computes (one var update and one Adam
updater per weight, a ``Conv`` per convolution) agree with upstream's; counts of
PopART's own rewrites (inserted casts, stashes, inplace variants) do not.
"""
from __future__ import annotations

import json
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx

from ipuxl.ir import meta
from ipuxl.poptorch_compat.compile.optimizer_log import popart_tensor_name
from ipuxl.poptorch_compat.compile.translate import ParamPlan

__all__ = ["popart_ir", "popart_op_type"]

# aten (overload packet name) or PopXL op -> PopART's op type
_TYPES: dict[str, str] = {
    "addmm": "MatMul", "mm": "MatMul", "bmm": "MatMul", "matmul": "MatMul", "linear": "MatMul",
    "convolution": "Conv", "max_pool2d_with_indices": "MaxPool", "max_pool1d": "MaxPool", "max_pool2d": "MaxPool",
    "avg_pool2d": "AveragePool", "avg_pool1d": "AveragePool", "adaptive_avg_pool2d": "AveragePool",
    "relu": "Relu", "gelu": "Gelu", "tanh": "Tanh", "sigmoid": "Sigmoid", "silu": "Swish", "elu": "Elu",
    "leaky_relu": "LeakyRelu", "hardtanh": "Clip", "clamp": "Clip", "clamp_min": "Max", "clamp_max": "Min",
    "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "rsqrt": "Rsqrt", "reciprocal": "Reciprocal", "neg": "Neg",
    "negate": "Neg", "abs": "Abs", "sign": "Sign", "floor": "Floor", "ceil": "Ceil", "round": "Round",
    "erf": "Erf", "sin": "Sin", "cos": "Cos", "pow": "Pow", "add": "Add", "sub": "Sub", "rsub": "Sub",
    "mul": "Mul", "div": "Div", "remainder": "Remainder", "fmod": "Fmod", "where": "Where",
    "eq": "Equal", "ne": "NotEqual", "lt": "Less", "gt": "Greater", "le": "LessOrEqual", "ge": "GreaterOrEqual",
    "logical_and": "And", "logical_or": "Or", "logical_not": "Not", "bitwise_not": "Not",
    "_softmax": "Softmax", "softmax": "Softmax", "_log_softmax": "LogSoftmax", "log_softmax": "LogSoftmax",
    "nll_loss_forward": "Nll", "nll_loss2d_forward": "Nll", "nll_loss": "Nll", "nll_loss2d": "Nll", "mse_loss": "L2", "l1_loss": "L1",
    "native_layer_norm": "GroupNormalization", "native_group_norm": "GroupNormalization",
    "native_batch_norm": "BatchNormalization", "_native_batch_norm_legit_no_training": "BatchNormalization",
    "_native_batch_norm_legit_functional": "BatchNormalization",
    "native_dropout": "Dropout", "dropout": "Dropout",
    "_to_copy": "Cast", "to": "Cast", "cast": "Cast", "clone": "Identity", "alias": "Identity",
    "view": "Reshape", "reshape": "Reshape", "_unsafe_view": "Reshape", "flatten": "Flatten",
    "t": "Transpose", "transpose": "Transpose", "permute": "Transpose", "expand": "Expand",
    "squeeze": "Squeeze", "unsqueeze": "Unsqueeze", "cat": "Concat", "stack": "Concat", "split": "Split",
    "split_with_sizes": "Split", "slice": "Slice", "select": "Slice", "narrow": "Slice",
    "index_select": "Gather", "embedding": "Gather", "gather": "GatherElements", "index": "Gather",
    "scatter": "ScatterElements", "scatter_add": "ScatterReduce", "scatter_reduce": "ScatterReduce",
    "index_put": "ScatterElements", "sum": "ReduceSum", "mean": "ReduceMean", "amax": "ReduceMax",
    "amin": "ReduceMin", "max": "ReduceMax", "min": "ReduceMin", "prod": "ReduceProd", "argmax": "ArgMax",
    "argmin": "ArgMin", "topk": "TopK", "cumsum": "CumSum", "full": "ConstantOfShape", "zeros": "ConstantOfShape",
    "ones": "ConstantOfShape", "fill": "ConstantOfShape", "arange": "Range", "constant_pad_nd": "Pad",
    "upsample_nearest2d": "Resize", "upsample_bilinear2d": "Resize", "one_hot": "OneHot", "onehot": "OneHot",
    # PopXL ops ipuxl's optimisers and loops use
    "adam_updater": "AdamUpdater", "lamb_square": "LambSquare", "scaled_add_": "ScaledAddLhsInplace",
    "scaled_add": "ScaledAdd", "accumulate_": "Accumulate", "accumulate_moving_average_": "Accumulate",
    "accumulate_moving_average_square_": "Accumulate", "accumulate_square_": "Accumulate",
    "accumulator_scale_": "AccumulatorScale", "accumulator_zero_": "AccumulatorZero",
    "copy_var_update_": "CopyVarUpdate", "var_update": "VarUpdate", "increment_mod": "IncrementMod",
    "replicated_all_reduce": "ReplicatedAllReduce", "replicated_all_reduce_": "ReplicatedAllReduceInplace",
    "print_tensor": "PrintTensor", "identity_loss": "IdentityLoss",
}
# PopART's var update of each optimiser rule (SGD: by momentum and accumulator variant)
_VAR_UPDATES = {"adam": "AdamVarUpdate", "lamb": "AdamVarUpdate", "rmsprop": "AdamVarUpdate"}
_SKIPPED = {"host_load", "host_store", "output_of", "call", "repeat"}


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.strip("_").split("_") if part)


def popart_op_type(node: fx.Node) -> str:
    """PopART's op type of an fx node ipuxl runs (see the module docstring)."""
    popxl_op = node.meta.get(meta.OP)
    if isinstance(popxl_op, str) and popxl_op in _TYPES:
        return _TYPES[popxl_op]
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    name = str(getattr(packet, "__name__", None) or popxl_op or target)
    name = name.rstrip("_") if name.endswith("_") and name.rstrip("_") in _TYPES else name
    if name in _TYPES:
        return _TYPES[name]
    for suffix in ("_backward_data", "_backward_input", "_backward"):
        if name.endswith(suffix):
            forward = name[:-len(suffix)]
            return (_TYPES.get(forward) or _camel(forward)) + "Grad"
    return _camel(name)


def _var_update(plan: ParamPlan) -> str:
    if plan.rule != "sgd":
        return _VAR_UPDATES[plan.rule]
    if plan.hypers.get("momentum", 0.0) == 0.0 and "momentum" not in plan.variable:
        return "SGD0VarUpdate"
    return "SGD1VarUpdate" if plan.flags.get("use_combined_accum", False) else "SGD2VarUpdate"


def _executed(graph: Any) -> Iterator[fx.Node]:
    """The nodes ``graph`` runs, calls expanded in place (a loop body once)."""
    for node in graph.fx.nodes:
        called = node.meta.get(meta.CALLED_GRAPH)
        if called is not None:
            yield from _executed(called)
        elif node.op == "call_function" and node.target is not operator.getitem \
                and node.meta.get(meta.OP) not in _SKIPPED:
            yield node


def _tensor(value: Any, name: str) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"name": name, "type": str(value.dtype).replace("torch.", ""), "shape": list(value.shape)}
    return {"name": name, "type": type(value).__name__, "shape": []}


def _names(node: fx.Node, params: dict[str, str]) -> str:
    name = node.meta.get(meta.NAME, node.name)
    return params.get(name, name)


def popart_ir(ir: Any, plans: list[ParamPlan], *, training: bool) -> str:
    """The dump of the program ``ir`` (see the module docstring) as JSON text; ``plans``
    are the trained parameters' optimiser plans (empty for inference)."""
    params = {plan.name: popart_tensor_name(plan.name, training=training) for plan in plans}
    rules = {plan.name: plan for plan in plans}
    nodes = list(_executed(ir.main_graph))
    last_write: dict[str, int] = {}
    for index, node in enumerate(nodes):
        modified = node.meta.get(meta.MODIFIES)
        if modified is not None:
            last_write[_names(modified, {})] = index
    var_updates = {index: _var_update(rules[name]) for name, index in last_write.items() if name in rules}
    ops = []
    for index, node in enumerate(nodes):
        kind = var_updates.get(index) or popart_op_type(node)
        inputs = [_tensor(arg.meta.get("val"), _names(arg, params)) for arg in node.all_input_nodes]
        outputs = [_tensor(node.meta.get("val"), _names(node, params))]
        ops.append({"type": kind, "name": f"{kind}:{index}", "inputs": inputs, "outputs": outputs, "attributes": {}})
    return json.dumps({"maingraph": ops})
