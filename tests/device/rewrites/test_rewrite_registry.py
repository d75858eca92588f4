"""The rewrite registry (``ipuxl.device.rewrites``): the session runs ``REWRITES`` in their
order, each once, and keeps which of them changed each compiled graph, truthfully.

Graphs are built by hand (a lowered graph's shape: meta tensors on the nodes), so each
rewrite's effect is known; the same graph is run before and after (numbers unchanged).
"""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.fx as fx

import ipuxl
import ipuxl.ops as ops
from ipuxl.device.rewrites import REWRITES, apply_rewrites
from ipuxl.passes.result import PassResult

aten = torch.ops.aten
ORDER = ("eliminate_dead_code", "fuse_embedding_grads", "fuse_cross_entropy_grads", "fuse_matmul_updates",
         "fuse_sgd_momentum_steps", "fuse_adam_steps", "fuse_adam_updates", "call_random_ops_directly",
         "select_kernels")


def _node(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args], **kwargs)
    return node


def _update_graph(dead_code: bool) -> fx.Graph:
    """``W += -0.1 * mm(a, g)`` (an SGD update of a matmul gradient); with ``dead_code`` also
    an unread ``relu(a)``."""
    graph = fx.Graph()
    w, a, g = (graph.placeholder(n) for n in ("w", "a", "g"))
    for node, shape in ((w, (4, 5)), (a, (4, 3)), (g, (3, 5))):
        node.meta["val"] = torch.empty(shape, device="meta")
    if dead_code:
        _node(graph, aten.relu.default, a)
    grad = _node(graph, aten.mm.default, a, g)
    update = graph.call_function(torch.Tensor.add_, (w, grad), {"alpha": -0.1})
    update.meta["val"] = w.meta["val"]
    graph.output(update)
    return graph


def _run(graph: fx.Graph) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    w, a, g = (torch.randn(shape, generator=gen) for shape in ((4, 5), (4, 3), (3, 5)))
    return fx.GraphModule(torch.nn.Module(), graph)(w, a, g)


def test_the_session_runs_the_rewrites_in_this_order():
    assert tuple(r.__name__ for r in REWRITES) == ORDER


def test_apply_rewrites_reports_only_the_rewrites_that_changed_the_graph():
    graph = _update_graph(dead_code=False)
    want = _run(copy.deepcopy(graph))
    rewritten = apply_rewrites(graph)
    assert rewritten.applied == ("fuse_matmul_updates",)  # nothing dead, no Adam, no random op, no kernel swap
    assert rewritten.graph is graph
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [torch.Tensor.addmm_]
    torch.testing.assert_close(_run(graph), want)  # the fused update may differ in the last bit


def test_apply_rewrites_lists_several_changes_in_the_order_they_ran():
    graph = _update_graph(dead_code=True)
    want = _run(copy.deepcopy(graph))
    assert apply_rewrites(graph).applied == ("eliminate_dead_code", "fuse_matmul_updates")
    assert not [n for n in graph.nodes if n.target is aten.relu.default]
    torch.testing.assert_close(_run(graph), want)
    assert apply_rewrites(graph).applied == ()  # a second run finds nothing left to do


def test_each_rewrite_gets_the_previous_ones_graph_and_runs_once():
    calls = []

    def first(graph: fx.Graph) -> PassResult:
        calls.append(("first", graph))
        return PassResult(fx.Graph(), True)  # a pass may return a new graph

    def second(graph: fx.Graph) -> PassResult:
        calls.append(("second", graph))
        return PassResult(graph, False)

    start = fx.Graph()
    rewritten = apply_rewrites(start, (first, second))
    assert [name for name, _ in calls] == ["first", "second"]
    assert calls[0][1] is start and calls[1][1] is not start and rewritten.graph is calls[1][1]
    assert rewritten.applied == ("first",)


def test_the_session_keeps_which_rewrites_changed_each_compiled_graph():
    """A called graph with a seeded random op (retargeted to its implementation), called
    twice (so compiled to a function of its own); the main graph around it needs none of
    the rewrites. The values are the custom op's, run eagerly."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        seed = ipuxl.variable(np.array([1, 2], np.uint32), ipuxl.uint32, name="seed")
        x = ipuxl.variable(np.ones((2, 3), np.float32), ipuxl.float32, name="x")

        def noisy(seed_t, t):
            return t + ops.random_uniform(seed_t, (2, 3))

        graph = ir.create_graph(noisy, seed, x)
        y = ops.call(graph, seed, x)[0] * ops.call(graph, seed, x)[0]
        out = ipuxl.d2h_stream(y.shape, y.dtype, name="y")
        ops.host_store(out, y)
    with ipuxl.Session(ir, "cpu") as session:
        compiled = session.compiled_graph(graph)
        assert compiled is not None and compiled.rewrites == ("call_random_ops_directly",)
        assert session.applied_rewrites == {ir.main_graph: (), graph: ("call_random_ops_directly",)}
        assert "ipuxl.random_uniform" not in compiled.module.code  # the implementation, not the custom op
        result = session.run()[out]
    draw = torch.ops.ipuxl.random_uniform(torch.tensor([1, 2], dtype=torch.uint32), [2, 3], 0.0, 1.0, torch.float32)
    torch.testing.assert_close(torch.from_numpy(result), (1 + draw) * (1 + draw))
