"""PopTorch's ops (``ipuxl.poptorch_compat.ops``) are PopTorch's top-level names."""
from __future__ import annotations

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import OpArgumentError
from ipuxl.poptorch_compat import ops as poptorch_ops
from tests.poptorch_compat._checks import raises_in

raises = raises_in(__file__)


def test_ops_are_poptorch_top_level_names():
    for name in ("for_loop", "cond", "dynamic_slice", "dynamic_update", "ipu_print_tensor", "nop",
                 "recomputationCheckpoint", "serializedMatMul", "set_available_memory", "set_overlap_for_input",
                 "set_overlap_for_output", "MultiConv", "NameScope", "CPU", "custom_op", "ctc_beam_search_decoder",
                 "fps", "nearest"):
        assert getattr(poptorch, name) is getattr(poptorch_ops, name)
    with poptorch.NameScope("encoder"):
        pass
    with raises(OpArgumentError, "Parameter to NameScope must be a string"):
        poptorch.NameScope(3)
