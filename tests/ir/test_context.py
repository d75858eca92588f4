"""The graph being built (``ipuxl.ir.context``): ``gmg``/``gir`` and ``name_scope``."""
from __future__ import annotations

import pytest

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import GraphContextError


def test_gmg_gir_return_the_main_graph_and_ir_while_building_a_subgraph():
    ir = ipuxl.Ir()
    seen = {}

    def body(x):
        seen.update(main=ipuxl.gmg(), main2=ipuxl.get_main_graph(), ir=ipuxl.gir(), ir2=ipuxl.get_ir())
        return x + 1

    with ir.main_graph:
        ir.create_graph(body, ipuxl.TensorSpec((2,), ipuxl.float32))
    assert seen["main"] is seen["main2"] is ir.main_graph and seen["ir"] is seen["ir2"] is ir


def test_gmg_outside_any_graph_is_a_graph_context_error():
    with pytest.raises(GraphContextError, match="no graph is being built") as info:
        ipuxl.gmg()
    assert isinstance(info.value, RuntimeError)


def test_name_scope_prefixes_names_and_nests():
    with ipuxl.Ir().main_graph:
        with ipuxl.name_scope("block") as scopes:
            assert scopes == ["block"]
            w = ipuxl.variable([1.0], name="w")
            with ipuxl.name_scope("inner"):
                y = ops.mul(w, 2.0)
            z = ops.add(y, 1.0, )
        after = ops.add(z, 1.0)
    assert w.name == "block/w" and y.name == "block/inner/mul" and z.name == "block/add"
    assert "block" not in after.name
