"""ipuxl: the IPU programming model (PopXL, popxl.addons, PopTorch) on PyTorch.

PopTorch-style use::

    model = ipuxl.trainingModel(net_with_loss, ipuxl.Options().deviceIterations(50),
                                optimizer=torch.optim.SGD(net.parameters(), lr=0.03))
    output, loss = model(data, labels)   # 50 steps on the device in one call

PopXL-style use::

    import ipuxl, ipuxl.ops as ops
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ops.host_load(ipuxl.h2d_stream((2,), ipuxl.float32, "x"))
        ...
"""
from ipuxl import dtypes, errors, ops, optim, transforms
from ipuxl.ir.graph_builder import Module, constant, graph_input, variable
from ipuxl.device import Session
from ipuxl.dtypes import (
    dtype, bfloat16, bool, float16, float32, float64, int8, int16, int32, int64, uint8, uint32,
)
from ipuxl.ir import (
    Constant, DeviceToHostStream, Graph, HostToDeviceStream, Ir, ReplicaGrouping, Tensor, TensorByRef, TensorSpec,
    Variable, d2h_stream, gcg, get_current_graph, h2d_stream, in_sequence,
)
from ipuxl.ops.random import create_seeds
from ipuxl.ir.context import replica_grouping
from ipuxl.poptorch_compat.options import AnchorMode, Options, OutputMode
from ipuxl.poptorch_compat.dataloader import DataLoader, DataLoaderMode
from ipuxl.poptorch_compat import PoplarExecutor, identity_loss, inferenceModel, trainingModel

__version__ = "0.1.0"

__all__ = [
    "dtypes", "errors", "ops", "optim", "transforms", "Module", "constant", "graph_input", "variable", "Session",
    "dtype", "bfloat16", "bool", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32",
    "Constant", "DeviceToHostStream", "Graph", "HostToDeviceStream", "Ir", "Tensor", "TensorByRef",
    "TensorSpec", "Variable", "ReplicaGrouping", "replica_grouping", "d2h_stream", "gcg", "get_current_graph", "h2d_stream", "in_sequence",
    "create_seeds", "__version__",
    "AnchorMode", "Options", "OutputMode", "DataLoader", "DataLoaderMode", "PoplarExecutor", "identity_loss",
    "inferenceModel", "trainingModel",
]
