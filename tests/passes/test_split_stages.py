"""passes.split_stages: the stage splitter both front ends' pipelining share."""
from __future__ import annotations

import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import PassError
from ipuxl.ir.lower import graph_callable
from ipuxl.ir.meta import VIEW_OF
from ipuxl.ir.verify import verify_ir
from ipuxl.passes.split_stages import StageSplitter

F32 = ipuxl.float32


class _Splitter(StageSplitter):
    def new_graph(self, stage):
        return self.graph.ir.new_subgraph(f"stage{stage}")

    def refuse_later(self, stage, node, later):
        return PassError(f"stage {stage} reads '{node.name}' of the later stage {later}")


def _program():
    """x @ w -> relu (stage 0); a view of it, doubled, plus x (stage 1); returns (graph, ops by name)."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        def body(x, w):
            a = x @ w
            b = ops.relu(a)
            flat = ops.reshape(b, (8,))
            d = flat * 2.0 + ops.reshape(x, (8,))
            return d, a

        graph = ir.create_graph(body, ipuxl.TensorSpec((2, 4), F32), ipuxl.TensorSpec((4, 4), F32))
    found = {n.name: n for n in graph.fx.nodes if n.op == "call_function"}
    return graph, found


def _stages(found, first_stage_ops):
    return {n: 0 if name in first_stage_ops else 1 for name, n in found.items()}


def test_ops_move_to_their_stage_and_values_cross_as_outputs_and_inputs():
    graph, found = _program()
    stage_of = _stages(found, ("matmul", "relu"))
    splitter = _Splitter(graph, stage_of)
    splitter.split(n for n in graph.fx.nodes if n in stage_of)
    d, a = (t.node for t in graph.outputs)
    assert [splitter.export(d), splitter.export(a)] == [0, 1]  # the caller's outputs, after relu (stage 1 read it)
    splitter.add_outputs()
    x, w = (t.node for t in graph.inputs)
    relu = found["relu"]

    assert list(splitter.graphs) == [0, 1]
    assert splitter.inputs == {0: [(x, None), (w, None)], 1: [(relu, 0), (x, None)]}
    assert {s: list(e) for s, e in splitter.exports.items()} == {0: [relu, a], 1: [d]}
    first, second = splitter.graphs[0], splitter.graphs[1]
    assert [n.name for n in first.fx.nodes if n.op == "call_function"] == ["matmul", "relu"]
    assert len(first.outputs) == 2 and len(second.outputs) == 1
    # the view's record names stage 1's input standing for relu, not the source graph's relu
    view = splitter.copies[1][found["relu_reshaped"]]
    assert view.meta[VIEW_OF] is splitter.copies[1][relu] is second.inputs[0].node
    assert graph.fx.nodes  # the source graph keeps its ops
    verify_ir(graph.ir)

    xv, wv = torch.randn(2, 4), torch.randn(4, 4)
    want_d, want_a = graph_callable(graph)(xv, wv)
    got_relu, got_a = graph_callable(first)(xv, wv)
    (got_d,) = graph_callable(second)(got_relu, xv)
    torch.testing.assert_close(got_d, want_d)
    torch.testing.assert_close(got_a, want_a)


def test_an_op_reading_a_later_stage_is_refused_by_the_front_ends_error():
    graph, found = _program()
    stage_of = _stages(found, ("relu",))  # relu (stage 0) reads matmul (stage 1)
    splitter = _Splitter(graph, stage_of)
    with pytest.raises(PassError, match="stage 0 reads 'matmul' of the later stage 1"):
        splitter.split(n for n in graph.fx.nodes if n in stage_of)


def test_read_outside_binds_a_value_without_making_it_an_input():
    graph, found = _program()
    stage_of = {n: 0 for n in found.values()}
    x = graph.inputs[0].node

    class _Bound(_Splitter):
        def read_outside(self, stage_graph, node):
            if node is not x:
                return None
            with stage_graph:
                return ipuxl.constant(torch.ones(2, 4).numpy(), name="ones").node

    splitter = _Bound(graph, stage_of)
    splitter.split(n for n in graph.fx.nodes if n in stage_of)
    (stage,) = splitter.graphs.values()
    assert splitter.inputs == {0: [(graph.inputs[1].node, None)]}
    assert [t.name for t in stage.inputs] == ["w"]
    assert splitter.copies[0][found["matmul"]].args[0].op == "get_attr"
