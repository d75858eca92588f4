"""Pins the public surface: ``__all__`` of ``ipuxl``, ``ipuxl.ops``, ``ipuxl.optim``, ``ipuxl.transforms``
and ``ipuxl.addons_compat``.

A change here is an API change: update the lists on purpose, never to make a test pass.
"""
from __future__ import annotations

import types

import pytest

import ipuxl
import ipuxl.ops
import ipuxl.addons_compat
import ipuxl.optim
import ipuxl.transforms

IPUXL = [
    "AnchorMode", "Constant", "DataLoader", "DataLoaderMode", "DeviceToHostStream", "Graph",
    "HostToDeviceStream", "Ir", "Module", "Options", "OutputMode", "PoplarExecutor", "ReplicaGrouping", "Session", "Tensor",
    "TensorByRef", "TensorSpec", "Variable", "__version__", "bfloat16", "bool", "constant", "create_seeds",
    "d2h_stream", "dtype", "dtypes", "errors", "float16", "float32", "float64", "gcg", "get_current_graph",
    "graph_input", "h2d_stream", "identity_loss", "in_sequence", "inferenceModel", "int16", "int32", "int64",
    "int8", "ops", "optim", "replica_grouping", "trainingModel", "transforms", "uint32", "uint8", "variable",
]

OPS = [
    "CallSiteInfo", "abs", "add", "add_", "argmax", "argmin", "average_pool", "call", "call_with_info", "cast",
    "ceil", "clip", "collectives", "concat", "conv", "cos", "create_seeds", "detach", "div", "dropout", "equal", "exp",
    "flatten", "floor", "fmod", "gather", "gelu", "getitem", "greater", "host_load", "host_store", "identity",
    "isinf", "isnan", "l1", "l2", "lamb_square", "layer_norm", "less", "log", "log_softmax", "logical_and",
    "logical_not", "logical_or", "logsumexp", "matmul", "max", "max_pool", "maximum", "mean", "min", "minimum",
    "mul", "negate", "nll_loss", "nll_loss_with_softmax_grad", "onehot", "pow", "prod", "random_normal",
    "random_uniform", "reduce_max", "reduce_mean", "reduce_min", "reduce_sum", "relu", "repeat",
    "repeat_with_info", "reshape", "scaled_add", "scaled_add_", "sigmoid", "sign", "sin", "slice", "softmax",
    "split", "split_random_seed", "sqrt", "squeeze", "sub", "sum", "sumsquare", "swish", "tanh", "transpose",
    "unsqueeze", "var_updates", "where",
]

TRANSFORMS = ["ExpectedConnection", "ExpectedConnectionType", "GradGraphInfo", "autodiff"]

ADDONS = [
    "BoundGraph", "Conv2D", "DotTree", "Embedding", "GraphCache", "GraphWithNamedArgs", "LayerNorm", "Linear",
    "Module", "NamedTensors", "NamedVariableFactories", "TensorMap", "VariableFactory", "add_variable_input",
    "autodiff", "autodiff_with_accumulation", "layers", "ops", "to_mapping",
]

OPTIM = [
    "Adam", "AdamUpdate", "AdamW", "AdamWUpdate", "LAMB", "LAMBUpdate", "RMSprop", "RMSpropUpdate", "SGD",
    "SGDUpdate", "apply_optimizer", "rules",
]

MODULES = [(ipuxl, IPUXL), (ipuxl.optim, OPTIM), (ipuxl.ops, OPS), (ipuxl.transforms, TRANSFORMS), (ipuxl.addons_compat, ADDONS)]


@pytest.mark.parametrize("module, expected", MODULES, ids=lambda v: getattr(v, "__name__", None))
def test_all_is_pinned(module, expected):
    assert expected == sorted(expected), "keep the pinned list sorted"
    assert len(module.__all__) == len(set(module.__all__)), "duplicate names in __all__"
    assert sorted(module.__all__) == expected


@pytest.mark.parametrize("module, expected", MODULES, ids=lambda v: getattr(v, "__name__", None))
def test_every_name_resolves(module, expected):
    for name in expected:
        assert getattr(module, name, None) is not None, f"{module.__name__}.{name} does not resolve"


def test_star_import_gives_exactly_all():
    namespace: dict = {}
    exec("from ipuxl import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == IPUXL


def test_kinds_of_public_names():
    assert ipuxl.__version__ == "0.1.0"
    for name in ("dtypes", "errors", "ops", "transforms"):
        assert isinstance(getattr(ipuxl, name), types.ModuleType)
    assert isinstance(ipuxl.ops.var_updates, types.ModuleType)
    assert isinstance(ipuxl.ops.collectives, types.ModuleType)
    for name in ("bfloat16", "bool", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
                 "uint8", "uint32"):
        assert getattr(ipuxl, name) is getattr(ipuxl.dtypes, name)
    for name in ("Constant", "DeviceToHostStream", "Graph", "HostToDeviceStream", "Ir", "Module", "ReplicaGrouping",
                 "Session", "Tensor", "TensorByRef", "TensorSpec", "Variable"):
        assert isinstance(getattr(ipuxl, name), type), name
    for name in OPS:
        if name not in ("var_updates", "collectives"):
            assert callable(getattr(ipuxl.ops, name)), name
    assert ipuxl.gcg is ipuxl.get_current_graph
    assert ipuxl.create_seeds is ipuxl.ops.create_seeds
