"""``rewrites.inverse_transposes``: pairs of transposing views that undo each other are
folded (structure), the results are the same bit for bit, and a second run changes nothing."""
from __future__ import annotations

import copy

import torch
import torch.fx as fx

from ipuxl.device.rewrites import fold_inverse_transposes

aten = torch.ops.aten


def _graph(build) -> fx.Graph:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, 3, 4, device="meta")
    out = build(graph, x)
    graph.output(out)
    return graph


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
    return node


def test_fold_inverse_transposes():
    def build(graph, x):
        p = _call(graph, aten.permute.default, x, [2, 0, 1])
        back = _call(graph, aten.permute.default, p, [1, 2, 0])  # undoes p
        tr = _call(graph, aten.transpose.int, x, 0, -1)
        tr_back = _call(graph, aten.transpose.int, tr, 2, 0)
        same = _call(graph, aten.permute.default, p, [2, 0, 1])  # does not undo p
        total = _call(graph, aten.add.Tensor, back, tr_back)
        return (_call(graph, aten.add.Tensor, total, _call(graph, aten.sum.default, same)), back)

    graph = _graph(build)
    x = torch.randn(2, 3, 4)
    want = fx.GraphModule(torch.nn.Module(), copy.deepcopy(graph))(x)
    assert fold_inverse_transposes(graph).modified
    adds = [n for n in graph.nodes if n.target is aten.add.Tensor]
    assert [a.name for a in adds[0].args] == ["x", "x"]
    assert not [n for n in graph.nodes if n.target is aten.transpose.int]
    assert len([n for n in graph.nodes if n.target is aten.permute.default]) == 3  # p, same, back (an output)
    got = fx.GraphModule(torch.nn.Module(), graph)(x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    result = fold_inverse_transposes(graph)
    assert result.graph is graph and not result.modified
