"""The pass contract: graph-in/graph-out passes return PassResult(graph, modified)."""
from __future__ import annotations

import numpy as np

import ipuxl
import ipuxl.ops as ops
from ipuxl.ir.calls import CallTarget
from ipuxl.ir.verify import verify_ir
from ipuxl.passes import PassResult, merge_identical_graphs, outline, reorder_for_memory
from ipuxl.passes.liveness import live_profile
from ipuxl.passes.schedule import program_order

F32 = ipuxl.float32


def _blocks(n: int):
    """x -> n x tanh(x @ w_i) + x, inline in the main graph; returns (ir, x stream, y stream)."""
    ir = ipuxl.Ir()
    rng = np.random.default_rng(0)
    with ir.main_graph:
        x_s = ipuxl.h2d_stream((2, 4), F32, "x")
        x = ops.host_load(x_s)
        for i in range(n):
            w = ipuxl.variable((rng.standard_normal((4, 4)) * 0.3).astype(np.float32), F32, name=f"w{i}")
            x = ops.tanh(x @ w) + x
        y_s = ipuxl.d2h_stream(x.shape, x.dtype, "y")
        ops.host_store(y_s, x)
    return ir, x_s, y_s


def _run(ir, x_s, y_s):
    data = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    with ipuxl.Session(ir, "cpu") as session:
        return session.run({x_s: data})[y_s]


def test_outline_returns_the_graph_and_whether_it_changed():
    expected = _run(*_blocks(6))
    ir, x_s, y_s = _blocks(6)
    result = outline(ir.main_graph, min_savings=0)
    assert isinstance(result, PassResult) and result == (ir.main_graph, True)
    assert outline(ir.main_graph, min_savings=0) == (ir.main_graph, False)  # nothing repeats any more
    verify_ir(ir)
    np.testing.assert_array_equal(_run(ir, x_s, y_s), expected)


def test_outline_of_an_ir_returns_the_ir():
    ir, _, _ = _blocks(6)
    assert outline(ir, min_savings=0) == (ir, True)
    single, _, _ = _blocks(1)
    assert outline(single, min_savings=0) == (single, False)


def test_merge_identical_graphs_returns_the_kept_graph():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.ones((2, 4), np.float32), F32, name="x")
        graphs = [ir.create_graph(lambda t: ops.tanh(t) * 2.0, x) for _ in range(3)]
        for g in graphs:
            (x,) = ops.call(g, x)
    assert merge_identical_graphs(graphs) == (graphs[0], True)
    assert [n.target.graph for n in ir.main_graph.fx.nodes if isinstance(n.target, CallTarget)] == [graphs[0]] * 3
    assert merge_identical_graphs(graphs[:1]) == (graphs[0], False)
    verify_ir(ir)


def test_reorder_for_memory_returns_the_graph_and_whether_the_order_changed():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ops.host_load(ipuxl.h2d_stream((64,), F32, "x"))
        outer = x.reshape((64, 1)) * x.reshape((1, 64))
        wide = [outer * float(i + 1) for i in range(3)]  # all built first: live at once in program order
        total = ops.sum(wide[0])
        for w in wide[1:]:
            total = total + ops.sum(w)
    graph = ir.main_graph
    before = live_profile(graph).peak_bytes
    assert reorder_for_memory(graph) == (graph, True)
    assert live_profile(graph).peak_bytes < before
    order = program_order(graph)
    assert reorder_for_memory(graph) == (graph, False)  # already in its memory schedule
    assert program_order(graph) == order
