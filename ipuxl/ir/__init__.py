"""The IR: ``Ir`` owns graphs (torch.fx Graphs), variables and host streams; ``verify_ir`` checks it."""
from ipuxl.ir.context import gcg, get_current_graph, in_sequence
from ipuxl.ir.graph import Graph
from ipuxl.ir.ir import Ir
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream, d2h_stream, h2d_stream
from ipuxl.ir.tensor import Constant, Tensor, TensorByRef, TensorSpec, Variable
from ipuxl.ir.verify import verify_graph, verify_ir

__all__ = [
    "gcg", "get_current_graph", "in_sequence", "Graph", "Ir", "ReplicaGrouping", "DeviceToHostStream",
    "HostToDeviceStream", "d2h_stream", "h2d_stream", "Constant", "Tensor", "TensorByRef", "TensorSpec", "Variable",
    "verify_graph", "verify_ir",
]
