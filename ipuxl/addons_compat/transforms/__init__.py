"""popxl.addons' transforms, one module each as upstream: ``autodiff``
(``autodiff``, ``autodiff_with_accumulation``), ``recomputation``
(``recompute_graph``), ``repeat_graph``, ``pipelining`` (``pipelined_execution``) and
``available_memory_proportion``."""
from ipuxl.addons_compat.transforms.available_memory_proportion import (
    set_available_memory_proportion_by_ipu, set_graph_available_memory_proportion_by_ipu,
)
from ipuxl.addons_compat.transforms.autodiff import autodiff, autodiff_with_accumulation
from ipuxl.addons_compat.transforms.batch_serialisation import (
    batch_serial_buffer, batch_serialise, batch_serialise_fwd_and_grad,
)
from ipuxl.addons_compat.transforms.pipelining import pipelined_execution
from ipuxl.addons_compat.transforms.recomputation import recompute_graph

__all__ = ["autodiff", "autodiff_with_accumulation", "recompute_graph", "pipelined_execution",
           "batch_serialise", "batch_serialise_fwd_and_grad", "batch_serial_buffer",
           "set_available_memory_proportion_by_ipu", "set_graph_available_memory_proportion_by_ipu"]
