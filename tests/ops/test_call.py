"""``ops.call`` and ``ops.repeat`` (``ipuxl.ops.call``): ``CallSiteInfo``'s index maps and tensor maps,
calls and repeats run as Python would (the ops harness's plumbing, checked directly), and the
gradient of a called graph that reads a constant."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import CallIndexError, CallInputError

from ._harness import check_op, randn, run_main


# -- CallSiteInfo -------------------------------------------------------------------------------
def test_call_site_info_index_maps_and_tensor_maps():
    ir = ipuxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a, b: (a + b, a * b), *[ipuxl.TensorSpec((2,), ipuxl.float32)] * 2)
        x, y = ipuxl.constant([1.0, 2.0]), ipuxl.constant([3.0, 4.0])
        info = ops.call_with_info(g, x, y)
    for i in range(2):
        assert info.graph_to_parent_input_index(i) == i == info.parent_to_graph_input_index(i)
        assert info.graph_to_parent_output_index(i) == i == info.parent_to_graph_output_index(i)
        assert info.parent_input(info.graph_to_parent_input_index(i)) is (x, y)[i]
        assert info.graph_to_parent(g.outputs[i]) is info.outputs[i]
    assert info.parent_to_graph(y) is g.inputs[1]
    with pytest.raises(CallIndexError, match="graph input index 2 is out of range") as exc:
        info.graph_to_parent_input_index(2)
    assert isinstance(exc.value, IndexError)
    with pytest.raises(IndexError):
        info.parent_to_graph_output_index(-1)
    with pytest.raises(CallInputError, match="not a parent input"):
        info.parent_to_graph(info.outputs[0])
    with pytest.raises(ValueError, match="not an input or output of the called graph"):
        info.graph_to_parent(x)


def test_call_and_repeat():
    x0 = randn((3,))

    def build(ir, load):
        g = ir.create_graph(lambda x, y: (x * 2.0 + y, y - 1.0), ipuxl.TensorSpec((3,), ipuxl.float64),
                            ipuxl.TensorSpec((3,), ipuxl.float64))
        x = load("x")
        a, b = ops.call(g, x, x)
        info = ops.call_with_info(g, x, x)
        r, s = ops.repeat(g, 3, x, x)
        r2, _ = ops.repeat_with_info(g, 0, x, x).outputs
        return {"a": a, "b": b, "c": info.outputs[0], "r": r, "s": s, "r2": r2}

    got = run_main(build, {"x": x0})
    np.testing.assert_allclose(got["a"], 3 * x0)
    np.testing.assert_allclose(got["b"], x0 - 1)
    np.testing.assert_allclose(got["c"], 3 * x0)
    x, y = x0, x0
    for _ in range(3):
        x, y = 2 * x + y, y - 1
    np.testing.assert_allclose(got["r"], x)
    np.testing.assert_allclose(got["s"], y)
    np.testing.assert_allclose(got["r2"], x0)


def test_autodiff_of_a_subgraph_reading_a_constant():
    c = np.arange(6.0).reshape(2, 3)
    check_op(lambda x: x * ipuxl.constant(c, name="c"), lambda x: x * torch.from_numpy(c), [(2, 3)])
