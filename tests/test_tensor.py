"""PopXL's ``popxl.tensor`` module (``ipuxl.tensor``): the names it exports."""
from __future__ import annotations

import ipuxl


def test_tensor_module_has_what_popxl_tensor_exports():
    from ipuxl.tensor import Constant, TensorByRef, Variable, graph_input, graph_output  # noqa: F401

    assert ipuxl.tensor.Variable is ipuxl.Variable and ipuxl.tensor.graph_input is ipuxl.graph_input
    assert graph_output is ipuxl.graph_output and Constant is ipuxl.Constant
    for alias in ("HostTensor", "HostScalarTensor", "TensorLike", "ScalarType"):
        assert hasattr(ipuxl.tensor, alias)
