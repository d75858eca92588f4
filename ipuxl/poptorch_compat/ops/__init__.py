"""PopTorch's ops (``poptorch.ops``: ``poptorch.for_loop``, ``cond``, ``ipu_print_tensor``, ``CPU``...) on ipuxl.

Each function takes upstream's arguments, defaults and checks, and works both
eagerly (plain PyTorch) and inside a ``trainingModel``/``inferenceModel`` forward,
where make_fx records the torch ops it runs. One module per kind of op:

* ``control_flow``: ``for_loop`` is unrolled while tracing (``count`` copies of the body
  in the program); ``cond`` computes both branches and selects (``torch.where``);
* ``tensor_ops``: ``dynamic_slice``, ``dynamic_update``, ``ctc_beam_search_decoder``,
  ``fps``, ``nearest``;
* ``host``: ``ipu_print_tensor`` and ``CPU`` are torch custom ops (``ipuxl.kernels``) that
  the device runs, so they print / call the host every time the program runs;
  ``custom_op`` runs a Python implementation registered with ``register_custom_op``;
* ``hints``: the ops that only steer Poplar (``set_available_memory``,
  ``serializedMatMul``'s mode, ``set_overlap_for_*``, ``recomputationCheckpoint``,
  ``MultiConv``, ``NameScope``) check their arguments as PopTorch does and change nothing;
* ``arguments``: the checks they share.
"""
from __future__ import annotations

from ipuxl.capture.mode import identity_loss
from ipuxl.poptorch_compat.ops.control_flow import cond, for_loop
from ipuxl.poptorch_compat.ops.hints import (
    Attribute, MultiConv, NameScope, nop, recomputationCheckpoint, serializedMatMul, set_available_memory, set_overlap_for_input,
    set_overlap_for_output,
)
from ipuxl.poptorch_compat.ops.host import CPU, custom_op, ipu_print_tensor, register_custom_op
from ipuxl.poptorch_compat.ops.tensor_ops import ctc_beam_search_decoder, dynamic_slice, dynamic_update, fps, nearest

__all__ = [
    "for_loop", "cond", "dynamic_slice", "dynamic_update", "ipu_print_tensor", "nop", "recomputationCheckpoint",
    "serializedMatMul", "set_available_memory", "set_overlap_for_input", "set_overlap_for_output", "MultiConv",
    "NameScope", "CPU", "custom_op", "register_custom_op", "identity_loss", "ctc_beam_search_decoder",
    "fps", "nearest", "Attribute",
]
