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

The PopXL core (``Ir``, ``Graph``, tensors, streams, ``ops``, dtypes, errors) loads
with the package; the rest loads on first use of one of its names (PEP 562): the
device (``Session``), the passes (``transforms``), the PopTorch front end
(``trainingModel``, ``Options``...) and the optimisers (``optim``). So a program that
only builds graphs, ``import ipuxl.ops`` included, does not pay for them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ipuxl import dtypes, errors, ops
from ipuxl.dtypes import (
    dtype, bfloat16, bool, float16, float32, float64, int8, int16, int32, int64, uint8, uint32,
)
from ipuxl.dtypes import complex64, complex128, double, float, half, uint16, uint64  # PopXL's aliases and types
from ipuxl.dtypes import float8_143, float8_152  # torch's float8 fnuz types (ipuxl.dtypes)
from ipuxl import tensor
from ipuxl.ir.context import get_ir, get_main_graph, gir, gmg, name_scope
from ipuxl.ir.graph_builder import graph_output
from ipuxl.ir import (
    Constant, DeviceToHostStream, Graph, HostToDeviceStream, Ir, ReplicaGrouping, Tensor, TensorByRef, TensorSpec,
    Variable, d2h_stream, gcg, get_current_graph, h2d_stream, in_sequence,
)
from ipuxl.ir.context import replica_grouping
from ipuxl.ir.placement import io_tiles, ipu
from ipuxl.ir.graph_builder import Module, constant, graph_input, variable
from ipuxl.ir.remote import (  # Streaming Memory and replicated tensor sharding
    RemoteBuffer, ReplicatedTensorSharding, TensorLocation, TensorStorage, remote_buffer,
    remote_replica_sharded_variable, remote_variable, replica_sharded_buffer, replica_sharded_variable,
)
from ipuxl.ops.random import create_seeds
from ipuxl.lazy import lazy_names

if TYPE_CHECKING:  # what the lazily loaded names are, for type checkers and readers
    from ipuxl import optim, transforms
    from ipuxl.device import Session
    from ipuxl.poptorch_compat import PoplarExecutor, identity_loss, inferenceModel, trainingModel
    from ipuxl.poptorch_compat.dataloader import DataLoader, DataLoaderMode
    from ipuxl.poptorch_compat.options import AnchorMode, Options, OutputMode

__version__ = "0.1.0"

#: name -> (module, attribute in it; None for the module itself), loaded on first use
_LAZY: dict[str, tuple[str, str | None]] = {
    "optim": ("ipuxl.optim", None),
    "utils": ("ipuxl.utils", None),
    "fp8_utils": ("ipuxl.fp8_utils", None),
    "transforms": ("ipuxl.transforms", None),
    "Session": ("ipuxl.device", "Session"),
    "AnchorMode": ("ipuxl.poptorch_compat.options", "AnchorMode"),
    "Options": ("ipuxl.poptorch_compat.options", "Options"),
    "OutputMode": ("ipuxl.poptorch_compat.options", "OutputMode"),
    "DataLoader": ("ipuxl.poptorch_compat.dataloader", "DataLoader"),
    "DataLoaderMode": ("ipuxl.poptorch_compat.dataloader", "DataLoaderMode"),
    "PoplarExecutor": ("ipuxl.poptorch_compat", "PoplarExecutor"),
    "identity_loss": ("ipuxl.poptorch_compat", "identity_loss"),
    "inferenceModel": ("ipuxl.poptorch_compat", "inferenceModel"),
    "trainingModel": ("ipuxl.poptorch_compat", "trainingModel"),
}


__getattr__, __dir__ = lazy_names("ipuxl", globals(), _LAZY)


__all__ = [
    "dtypes", "errors", "ops", "optim", "transforms", "Module", "constant", "graph_input", "variable", "Session",
    "dtype", "bfloat16", "bool", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32",
    "Constant", "DeviceToHostStream", "Graph", "HostToDeviceStream", "Ir", "Tensor", "TensorByRef",
    "TensorSpec", "Variable", "ReplicaGrouping", "replica_grouping", "d2h_stream", "gcg", "get_current_graph", "h2d_stream", "in_sequence",
    "create_seeds", "__version__",
    "half", "float", "double", "uint16", "uint64", "complex64", "complex128", "float8_143", "float8_152",
    "fp8_utils", "tensor", "utils", "graph_output",
    "gmg", "get_main_graph", "gir", "get_ir", "name_scope",
    "AnchorMode", "Options", "OutputMode", "DataLoader", "DataLoaderMode", "PoplarExecutor", "identity_loss",
    "inferenceModel", "trainingModel",
    "ipu", "io_tiles",
    "RemoteBuffer", "remote_buffer", "replica_sharded_buffer", "remote_variable", "remote_replica_sharded_variable",
    "replica_sharded_variable", "TensorLocation", "TensorStorage", "ReplicatedTensorSharding",
]
