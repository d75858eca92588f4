"""popxl.addons' ``route_tensor``: ``is_subgraph`` walks the graphs a graph calls, as
upstream's (its own test's cases); ``route_tensor_into_graph`` is named as not provided."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat.route_tensor import is_subgraph


def test_is_subgraph_follows_calls_through_any_depth():
    ir = ipuxl.Ir()
    g = ir.main_graph
    sg1, sg2, sg3 = (ir.create_empty_graph(name) for name in ("sg1", "sg2", "sg3"))
    with g:
        ops.call(sg1)
        assert is_subgraph(g, sg1)
    with sg1:
        ops.call(sg2)
        assert is_subgraph(g, sg2) and is_subgraph(sg1, sg2)
    with g:
        ops.call(sg3)
        assert is_subgraph(g, sg3)
        assert not is_subgraph(sg1, sg3)
        assert not is_subgraph(sg3, sg2)
    assert is_subgraph(sg3, sg3)  # a graph is its own subgraph, as upstream's walk starts from it
    assert not is_subgraph(sg1, g)


def test_is_subgraph_sees_repeat_bodies_and_both_conditional_branches():
    ir = ipuxl.Ir()
    spec = ipuxl.TensorSpec((2,), ipuxl.float32)
    body = ir.create_graph(lambda x: x + 1.0, spec)
    then_branch = ir.create_graph(lambda x: x * 2.0, spec)
    else_branch = ir.create_graph(lambda x: x - 2.0, spec)
    with ir.main_graph:
        x = ipuxl.variable(np.zeros(2, np.float32), name="x")
        (y,) = ops.repeat(body, 3, x)
        assert is_subgraph(ir.main_graph, body)
        assert not is_subgraph(ir.main_graph, then_branch)
        ops.conditional(ipuxl.constant(np.array(True)), then_branch, else_branch, [y], [y])
    assert is_subgraph(ir.main_graph, then_branch) and is_subgraph(ir.main_graph, else_branch)
    assert not is_subgraph(then_branch, else_branch)


def test_is_subgraph_is_exported_where_upstream_exports_it():
    route_tensor = importlib.import_module("ipuxl.addons_compat.route_tensor")
    assert addons.is_subgraph is route_tensor.is_subgraph is is_subgraph


def test_is_subgraph_errors_and_the_missing_route_tensor_into_graph():
    ir = ipuxl.Ir()
    with pytest.raises(TypeError, match="parent must be a Graph"):
        is_subgraph("main", ir.main_graph)
    route_tensor = importlib.import_module("ipuxl.addons_compat.route_tensor")
    with pytest.raises(AttributeError, match="route_tensor_into_graph is not provided by ipuxl"):
        route_tensor.route_tensor_into_graph  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'route_tensor_into_graph'"):
        from ipuxl.addons_compat.route_tensor import route_tensor_into_graph  # noqa: F401
