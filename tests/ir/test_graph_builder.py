"""Building graphs (``ipuxl.ir.graph_builder``): ``variable``'s arguments, and ``graph_output``
marking the outputs of a function that returns none."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl import errors
from ipuxl.errors import WrongGraphError

from tests._run import run


def test_variable_takes_popxls_arguments_and_no_others():
    import ipuxl

    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        with pytest.raises(errors.UnsupportedError, match="nan_on_overflow"):
            ipuxl.variable([1.0], nan_on_overflow=True)
        with pytest.raises(TypeError, match="unexpected keyword argument 'grouping'"):  # PopXL's is replica_grouping
            ipuxl.variable(np.zeros((2, 3), np.float32), grouping=ir.replica_grouping(group_size=1))
        v = ipuxl.variable(np.zeros((2, 3), np.float32), replica_grouping=ir.replica_grouping(group_size=1),
                           log2_scale=None, nan_on_overflow=None)
    assert v.shape == (3,)


# -- graph_output and create_graph outputs -------------------------------------------------
def test_graph_output_marks_outputs_of_a_function_returning_none():
    def body(x):
        y = x * 3.0
        ipuxl.graph_output(y)
        ipuxl.graph_output(x - 1.0)

    data = np.array([1.0, -2.0], np.float32)

    def build():
        g = ipuxl.gcg().ir.create_graph(body, ipuxl.TensorSpec((2,), ipuxl.float32))
        assert len(g.outputs) == 2
        a, b = ops.call(g, ipuxl.constant(data))
        return {"a": a, "b": b}

    out = run(build)
    torch.testing.assert_close(torch.from_numpy(out["a"]), torch.from_numpy(data) * 3.0)
    torch.testing.assert_close(torch.from_numpy(out["b"]), torch.from_numpy(data) - 1.0)


def test_graph_output_of_another_graphs_tensor_is_a_value_error():
    ir = ipuxl.Ir()
    with ir.main_graph:
        outer = ipuxl.constant([1.0])
        with pytest.raises(WrongGraphError, match="graph_output of tensor") as info:
            ir.create_graph(lambda x: ipuxl.graph_output(outer), ipuxl.TensorSpec((1,), ipuxl.float32))
    assert isinstance(info.value, ValueError)
