"""``ops.call`` and ``ops.repeat`` (``ipuxl.ops.call``): ``CallSiteInfo``'s index maps and tensor maps."""
from __future__ import annotations

import pytest

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import CallIndexError, CallInputError


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
