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
    "AnchorMode", "Constant", "DataLoader", "DataLoaderMode", "DeviceToHostStream", "Graph", "HostToDeviceStream",
    "Ir", "Module", "Options", "OutputMode", "PoplarExecutor", "ReplicaGrouping", "Session", "Tensor",
    "TensorByRef", "TensorSpec", "Variable", "__version__", "bfloat16", "bool", "complex128", "complex64",
    "constant", "create_seeds", "d2h_stream", "double", "dtype", "dtypes", "errors", "float", "float16", "float32",
    "float64", "gcg", "get_current_graph", "get_ir", "get_main_graph", "gir", "gmg", "graph_input", "graph_output",
    "h2d_stream", "half", "identity_loss", "in_sequence", "inferenceModel", "int16", "int32", "int64", "int8",
    "name_scope", "ops", "optim", "replica_grouping", "tensor", "trainingModel", "transforms", "uint16", "uint32",
    "uint64", "uint8", "utils", "variable"
]
IPUXL = sorted(IPUXL + [  # #17 Streaming Memory and sharding, #18 placement
    "RemoteBuffer", "ReplicatedTensorSharding", "TensorLocation", "TensorStorage", "io_tiles", "ipu", "remote_buffer",
    "remote_replica_sharded_variable", "remote_variable", "replica_sharded_buffer", "replica_sharded_variable",
])
IPUXL = sorted(IPUXL + ["float8_143", "float8_152", "fp8_utils"])  # PopXL's float8 (torch's fnuz types)

OPS = [
    "CallSiteInfo", "ConditionalSiteInfo", "PadType", "abs", "add", "add_", "argmax", "argmin", "average_pool",
    "batch_norm_inference", "call", "call_with_info", "cast", "ceil", "clamp", "clip", "collectives", "concat",
    "concat_", "conditional", "conditional_with_info", "conv", "conv_transpose", "cos", "create_seeds", "cumsum",
    "detach", "detach_", "div", "dropout", "dynamic_slice", "dynamic_update", "dynamic_update_", "equal", "exp",
    "exp_", "flatten", "flatten_", "floor", "fmod", "gather", "gelu", "gelu_", "geluerf", "geluerf_", "getitem",
    "greater", "group_norm", "histogram", "host_load", "host_store", "identity", "increment_mod", "increment_mod_",
    "init", "interpolate", "isfinite", "isinf", "isnan", "l1", "l2", "lamb_square", "layer_norm", "less", "log",
    "log2", "log_softmax", "logical_and", "logical_not", "logical_or", "logsum", "logsumexp", "matmul", "max",
    "max_pool", "maximum", "mean", "median", "min", "minimum", "mul", "negate", "nll_loss",
    "nll_loss_with_softmax_grad", "onehot", "pow", "print_tensor", "prod", "random_normal", "random_uniform",
    "reduce_max", "reduce_mean", "reduce_min", "reduce_sum", "relu", "relu_", "repeat", "repeat_with_info",
    "reshape", "reshape_", "roi_align", "scaled_add", "scaled_add_", "scatter", "scatter_reduce", "shaped_dropout",
    "sigmoid", "sign", "sin", "slice", "slice_", "softmax", "split", "split_random_seed", "sqrt", "squeeze", "sub",
    "subsample", "sum", "sumsquare", "swish", "swish_", "tanh", "tied_gather", "topk", "transpose", "transpose_",
    "unsqueeze", "var_updates", "where"
]
OPS = sorted(OPS + ["io_tile_copy", "ipu_copy", "remote_code_load", "remote_load", "remote_load_", "remote_store"])
OPS = sorted(OPS + ["conv_pow2scaled", "conv_transpose_pow2scaled", "matmul_pow2scaled", "pow2scale_cast_from_fp8",
                    "pow2scale_cast_to_fp8"])  # float8

TRANSFORMS = ["ExpectedConnection", "ExpectedConnectionType", "GradGraphInfo", "autodiff", "decompose_sum",
              "io_tile_exchange", "merge_exchange"]

ADDONS = [
    "BoundGraph", "Conv2D", "DotTree", "Embedding", "GraphCache", "GraphWithNamedArgs", "GroupNorm", "InputStreams",
    "LayerNorm", "Linear", "Module", "NamedReplicaGrouping", "NamedTensors", "NamedVariableFactories",
    "OutputStreams", "TensorMap", "VariableFactory", "add_variable_input", "array_munging", "autodiff",
    "autodiff_with_accumulation", "cross_entropy", "cross_entropy_with_grad", "host_load", "host_store", "layers",
    "named_replica_grouping", "ops", "optimizers", "seed_variable", "to_mapping", "transforms"
]
ADDONS = sorted(ADDONS + [  # #17: Streaming Memory, RTS, batch serialisation
    "NamedRemoteBuffers", "batch_serial_buffer", "batch_serialise", "batch_serialise_fwd_and_grad",
    "load_remote_graph", "named_variable_buffers", "pipelined_execution", "remote", "rts", "store_remote_graph",
])
ADDONS = sorted(ADDONS + [  # Graphcore's PopXL applications: tasks, utils, patterns, TP
    "GIT_COMMIT", "NamedTensorData", "OrderedDict", "TaskSession", "WeightsDict", "null_context", "patterns",
    "recompute_graph", "set_available_memory_proportion_by_ipu", "set_graph_available_memory_proportion_by_ipu",
    "suffix_graph_name", "timer", "utils",
])
ADDONS = sorted(ADDONS + ["is_subgraph", "route_tensor_into_graph"])  # popxl_addons.route_tensor

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
