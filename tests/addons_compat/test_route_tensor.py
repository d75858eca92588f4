"""popxl.addons' ``route_tensor``: ``is_subgraph`` walks the graphs a graph calls, as
upstream's (its own test's cases); ``route_tensor_into_graph`` re-wires the call sites already
built so a called graph reads (or, ``modified=True``, updates) a parent graph's tensor: the
programs run and give numpy's values."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat.route_tensor import is_subgraph, route_tensor_into_graph


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


def test_is_subgraph_errors():
    ir = ipuxl.Ir()
    with pytest.raises(TypeError, match="parent must be a Graph"):
        is_subgraph("main", ir.main_graph)


def _run(ir, *streams):
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run()
        return [out[s] for s in streams], session


def test_a_routed_tensor_reaches_every_call_site_and_nested_graphs():
    """main calls sg1 twice; sg1 calls sg2 and sg3, which calls sg2 again: sg2 reads ``a`` and
    adds it into ``total`` (both routed in after every call was built)."""
    ir = ipuxl.Ir()
    g = ir.main_graph
    sg1, sg2, sg3 = (ir.create_empty_graph(name) for name in ("sg1", "sg2", "sg3"))
    with g:
        a = ipuxl.variable(np.array([1.0, 2.0], np.float32), name="a")
        total = ipuxl.variable(np.zeros(2, np.float32), name="total")
        ops.call(sg1)
        ops.call(sg1)
    with sg1:
        ops.call(sg2)
        ops.call(sg3)
    with sg3:
        ops.call(sg2)
    with sg2:
        a_in = route_tensor_into_graph(a)
        assert route_tensor_into_graph(a) is a_in  # routed once
        ops.var_updates.accumulate_(route_tensor_into_graph(total, modified=True), a_in * 10.0)
    assert len(sg1.inputs) == len(sg2.inputs) == len(sg3.inputs) == 2
    assert sum(isinstance(t, ipuxl.Variable) for t in g.tensors) == 2
    _, session = _run(ir)
    np.testing.assert_array_equal(session.get_tensor_data(total), np.array([40.0, 80.0], np.float32))
    np.testing.assert_array_equal(session.get_tensor_data(a), np.array([1.0, 2.0], np.float32))


def test_modified_routes_by_reference_through_a_repeat():
    ir = ipuxl.Ir()
    g = ir.main_graph
    body, step = ir.create_empty_graph("body"), ir.create_empty_graph("step")
    with g:
        count = ipuxl.variable(np.float32(0), name="count")
        ops.repeat(body, 5)
    with body:
        ops.call(step)
    with step:
        ops.var_updates.accumulate_(route_tensor_into_graph(count, modified=True), ipuxl.constant(np.float32(2)))
    with g:
        total = ipuxl.d2h_stream((), ipuxl.float32, "total")
        ops.host_store(total, count + 0.0)
    (result,), session = _run(ir, total)
    assert float(result) == 10.0 and float(session.get_tensor_data(count)) == 10.0


def test_routing_errors_are_upstreams_value_error():
    ir = ipuxl.Ir()
    g = ir.main_graph
    sg = ir.create_empty_graph("sg1")
    with g:
        a = ipuxl.variable(1.0)
    with pytest.raises(ValueError, match="is not in the graph sg1") as info:
        route_tensor_into_graph(a, sg)
    assert "is not in a known parent graph" in str(info.value)
    with g:
        assert route_tensor_into_graph(a) is a  # already there

    other = ir.create_empty_graph("other")
    with g:
        ops.call(sg)
    with other:
        ops.call(sg)  # sg is also called from a graph that cannot see a
    with sg, pytest.raises(ValueError, match="also called from graph other"):
        route_tensor_into_graph(a)
    with pytest.raises(TypeError, match="takes a Tensor"):
        route_tensor_into_graph(np.ones(2), sg)
