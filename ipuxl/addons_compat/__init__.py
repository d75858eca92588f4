"""popxl.addons compatibility: ``import ipuxl.addons_compat as addons``.

Reproduces popxl.addons' Module, DotTree/NamedTensors, variable factories,
GraphWithNamedArgs, BoundGraph, GraphCache, transforms (autodiff, recomputation,
repeat_graph), ops (cross entropy, host transfers), layers, optimisers,
``InputStreams``/``OutputStreams``, ``seed_variable``, ``NamedReplicaGrouping``,
``array_munging``, ``testing_utils``, ``TaskSession``, ``utils`` (``timer``...),
``patterns`` and the tensor-parallel ops and layers on ipuxl's core API, module by
module as upstream lays them out.

``GIT_COMMIT`` is upstream's short commit of the popxl.addons checkout in use, which
programs log; here it names the ipuxl release that provides popxl.addons (``"ipuxl-0.1.0"``).
"""
from ipuxl import __version__
from ipuxl.addons_compat import (
    array_munging, layers, named_replica_grouping, ops, optimizers, patterns, transforms, utils,
)
from ipuxl.addons_compat.dot_tree import DotTree, to_mapping
from ipuxl.addons_compat.graph import BoundGraph, GraphWithNamedArgs
from ipuxl.addons_compat.graph_cache import GraphCache
from ipuxl.addons_compat.layers import Conv2D, Embedding, GroupNorm, LayerNorm, Linear
from ipuxl.addons_compat.module import Module
from ipuxl.addons_compat.named_replica_grouping import NamedReplicaGrouping
from ipuxl.addons_compat.named_tensors import NamedTensorData, NamedTensors, TensorMap
from ipuxl.addons_compat.ops import cross_entropy, cross_entropy_with_grad, host_load, host_store
from ipuxl.addons_compat.random_seed import seed_variable
from ipuxl.addons_compat.route_tensor import is_subgraph, route_tensor_into_graph
from ipuxl.addons_compat.streams import InputStreams, OutputStreams
from ipuxl.addons_compat.task_session import TaskSession
from ipuxl.addons_compat.transforms import (
    autodiff, autodiff_with_accumulation, recompute_graph, set_available_memory_proportion_by_ipu,
    set_graph_available_memory_proportion_by_ipu,
)
from ipuxl.addons_compat.utils import OrderedDict, WeightsDict, null_context, suffix_graph_name, timer
from ipuxl.addons_compat.transforms.pipelining import pipelined_execution
from ipuxl.addons_compat.variable_factory import NamedVariableFactories, VariableFactory, add_variable_input
from ipuxl.addons_compat import remote, rts  # Streaming Memory and RTS
from ipuxl.addons_compat.remote import NamedRemoteBuffers, load_remote_graph, named_variable_buffers, store_remote_graph
from ipuxl.addons_compat.transforms.batch_serialisation import (
    batch_serial_buffer, batch_serialise, batch_serialise_fwd_and_grad,
)

GIT_COMMIT: str | None = f"ipuxl-{__version__}"

__all__ = [
    "array_munging", "layers", "named_replica_grouping", "ops", "optimizers", "patterns", "transforms", "utils",
    "DotTree", "GIT_COMMIT", "NamedTensorData", "TaskSession", "recompute_graph",
    "set_available_memory_proportion_by_ipu", "set_graph_available_memory_proportion_by_ipu", "OrderedDict",
    "WeightsDict", "null_context", "suffix_graph_name", "timer",
    "to_mapping", "BoundGraph", "GraphWithNamedArgs", "GraphCache", "Conv2D", "Embedding", "GroupNorm",
    "LayerNorm", "Linear", "Module", "NamedReplicaGrouping", "NamedTensors", "TensorMap", "cross_entropy",
    "cross_entropy_with_grad", "host_load", "host_store", "seed_variable", "InputStreams", "OutputStreams",
    "autodiff", "autodiff_with_accumulation", "NamedVariableFactories", "VariableFactory", "add_variable_input",
    "is_subgraph",
    "route_tensor_into_graph",
    "pipelined_execution",
    # Streaming Memory and RTS
    "remote", "rts", "NamedRemoteBuffers", "load_remote_graph", "named_variable_buffers", "store_remote_graph",
    "batch_serial_buffer", "batch_serialise", "batch_serialise_fwd_and_grad",
]
