"""passes.outline: repeated regions become calls of one graph; results do not change."""
from __future__ import annotations

import numpy as np
import pytest

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import OutlineError
from ipuxl.ir.calls import CallTarget
from ipuxl.ir.verify import verify_ir
from ipuxl.passes.outline import deduplicate, outline_graph, outline_ir

F32 = ipuxl.float32


def _ops(graph):
    return [n for n in graph.fx.nodes if n.op == "call_function"]


def _code_ops(ir) -> int:
    """Op instances in compiled code: every graph once; tuple items and calls excluded."""
    return sum(1 for g in ir.graphs for n in _ops(g)
               if n.target.__class__ is not CallTarget and n.meta.get("ipuxl_op") != "output_of"
               and n.target.__name__ != "getitem")


def _residual_mlp(blocks: int, with_update: bool = False):
    """Main graph: x -> N x (gelu(x @ w_i + b_i) + x), built inline; optionally w_i += 0.01 * x^T x-ish."""
    ir = ipuxl.Ir()
    rng = np.random.default_rng(0)
    with ir.main_graph:
        x_s = ipuxl.h2d_stream((4, 8), F32, "x")
        x = ops.host_load(x_s)
        weights = []
        for i in range(blocks):
            w = ipuxl.variable((rng.standard_normal((8, 8)) * 0.2).astype(np.float32), F32, name=f"w{i}")
            b = ipuxl.variable(np.zeros(8, np.float32), F32, name=f"b{i}")
            h = ops.gelu(x @ w + b)
            if with_update:
                ops.scaled_add_(w, x.T @ h, 1.0, -0.01)  # writes the variable: the call passes it by reference
            x = h + x
            weights.append(w)
        y_s = ipuxl.d2h_stream(x.shape, x.dtype, "y")
        ops.host_store(y_s, x)
    return ir, x_s, y_s, weights


def _run(ir, x_s, y_s, weights, data, runs: int = 1):
    with ipuxl.Session(ir, "cpu") as session:
        for _ in range(runs):
            y = session.run({x_s: data})[y_s]
        return y, [session.get_tensor_data(w).copy() for w in weights]


@pytest.mark.parametrize("blocks", [4, 12, 48])
def test_repeated_blocks_become_one_graph_and_results_are_bitwise_unchanged(blocks):
    data = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    reference = _run(*_residual_mlp(blocks), data)
    ir, x_s, y_s, weights = _residual_mlp(blocks)
    inlined = _code_ops(ir)
    made = outline_graph(ir.main_graph)
    verify_ir(ir)
    assert len(made) == 1
    block = made[0]
    assert len(_ops(block)) == 4  # matmul, add, gelu, add
    calls = [n for n in ir.main_graph.fx.nodes if isinstance(n.target, CallTarget)]
    assert len(calls) == blocks and all(c.target.graph is block for c in calls)
    assert inlined == 4 * blocks + 2  # + host_load, host_store
    assert _code_ops(ir) == 4 + 2  # constant in N
    y, _ = _run(ir, x_s, y_s, weights, data)
    np.testing.assert_array_equal(y, reference[0])


def test_in_place_updates_in_blocks_reach_the_callers_variables():
    data = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    y_ref, w_ref = _run(*_residual_mlp(6, with_update=True), data, runs=3)
    ir, x_s, y_s, weights = _residual_mlp(6, with_update=True)
    (block,) = outline_graph(ir.main_graph)
    verify_ir(ir)
    assert any(t.node.meta.get("ipuxl_by_ref") for t in block.inputs)
    y, w = _run(ir, x_s, y_s, weights, data, runs=3)
    np.testing.assert_array_equal(y, y_ref)
    for got, expected in zip(w, w_ref):
        np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(w[0], ir.variable_records["w0"].data)  # the updates did run


def test_nothing_to_outline_leaves_the_graph_alone():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.ones(3, np.float32), F32, name="x")
        y = ops.exp(ops.relu(x) * 2.0)
        ops.host_store(ipuxl.d2h_stream(y.shape, y.dtype, "y"), ops.log(y))
    before = [n.name for n in ir.main_graph.fx.nodes]
    assert outline_graph(ir.main_graph) == []
    verify_ir(ir)
    assert [n.name for n in ir.main_graph.fx.nodes] == before


def test_blocks_that_differ_in_shape_are_not_merged():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.ones((2, 4), np.float32), F32, name="x")
        for width in (4, 4, 6, 6, 6):  # blocks 1-2 and 4-5 are identical (block 3 maps 4 -> 6 wide)
            w = ipuxl.variable(np.ones((x.shape[1], width), np.float32), F32, name="w")
            x = ops.gelu(x @ w) * 0.5
        ops.host_store(ipuxl.d2h_stream(x.shape, x.dtype, "y"), x)
    summary = outline_ir(ir, min_savings=0)
    verify_ir(ir)
    assert len(summary.graphs) == 2
    for graph in summary.graphs:
        shapes = {tuple(n.meta["val"].shape) for n in _ops(graph)}
        assert len({s[-1] for s in shapes}) == 1  # one width per shared graph


# -- deduplicate -----------------------------------------------------------------------------------------------
def _per_block_graphs(widths):
    """One graph created per block (identical code built N times), each called once."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x_s = ipuxl.h2d_stream((2, 4), F32, "x")
        x = ops.host_load(x_s)
        graphs = []
        for i, width in enumerate(widths):
            w = ipuxl.variable(np.full((4, width), 0.1 * (i + 1), np.float32), F32, name=f"w{i}")
            g = ir.create_graph(lambda t, v: ops.tanh(t @ v) + 1.0, x, w)
            graphs.append(g)
            (y,) = ops.call(g, x, w)
            x = y[:, :4] if width != 4 else y
        y_s = ipuxl.d2h_stream(x.shape, x.dtype, "y")
        ops.host_store(y_s, x)
    return ir, x_s, y_s, graphs


def test_deduplicate_merges_identical_graphs():
    data = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    ir, x_s, y_s, graphs = _per_block_graphs([4, 4, 4])
    with ipuxl.Session(ir) as s:
        expected = s.run({x_s: data})[y_s]
    ir, x_s, y_s, graphs = _per_block_graphs([4, 4, 4])
    kept = deduplicate(graphs)
    verify_ir(ir)
    assert kept is graphs[0] and graphs[1] not in ir.graphs
    called = [n.target.graph for n in ir.main_graph.fx.nodes if isinstance(n.target, CallTarget)]
    assert called == [kept] * 3
    with ipuxl.Session(ir) as s:
        np.testing.assert_array_equal(s.run({x_s: data})[y_s], expected)


def test_deduplicate_says_what_differs():
    ir, _, _, graphs = _per_block_graphs([4, 6])
    with pytest.raises(OutlineError, match=r"(?s)not identical.*input 'v' \(4, 4\).*vs input 'v' \(4, 6\)"):
        deduplicate(graphs)
    ir = ipuxl.Ir()
    with ir.main_graph:
        spec = ipuxl.TensorSpec((3,), F32)
        a = ir.create_graph(lambda t: ops.exp(t) * 2.0, spec)
        b = ir.create_graph(lambda t: ops.log(t) * 2.0, spec)
    with pytest.raises(OutlineError, match=r"(?s)item 1 differs: op 'exp'.*vs op 'log'"):
        deduplicate([a, b])


def test_small_repeats_stay_inline_by_default():
    """Two copies of a 3-op layer save less than MIN_SAVINGS: left inline (fusion stays possible)."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.ones((2, 4), np.float32), F32, name="x")
        for _ in range(2):
            x = ops.relu(x @ ipuxl.variable(np.eye(4, dtype=np.float32), F32, name="w") + 1.0)
        ops.host_store(ipuxl.d2h_stream(x.shape, x.dtype, "y"), x)
    assert outline_graph(ir.main_graph) == []
    assert len(outline_graph(ir.main_graph, min_savings=0)) == 1
    verify_ir(ir)


def test_repeats_are_not_cut_between_a_call_and_its_items():
    """Each block reads the two outputs of a called graph; the first block's graph differs, so
    the repeats line up as [items of the previous call, ops, next call]: a region that started
    at the ``getitem``s of a call outside it took the call's tuple as an input (AttributeError
    in timm's EfficientFormerV2, whose blocks read their grad graphs' outputs). The results
    stay those of the inline program."""
    def build():
        ir = ipuxl.Ir()
        with ir.main_graph:
            x_s = ipuxl.h2d_stream((4, 8), F32, "x")
            x = ops.host_load(x_s)
            weights = []
            first = ir.create_graph(lambda t: (ops.tanh(t) * 2.0, ops.exp(t) * 2.0), x)
            g = ir.create_graph(lambda t: (ops.tanh(t), ops.exp(t)), x)
            for i in range(4):  # the first block calls another graph: the repeats start after its call
                a, b = ops.call(first if i == 0 else g, x)
                w = ipuxl.variable(np.full((8, 8), 0.05 * (i + 1), np.float32), F32, name=f"w{i}")
                weights.append(w)
                x = ops.gelu(a @ w) + b * 0.01
            y_s = ipuxl.d2h_stream(x.shape, x.dtype, "y")
            ops.host_store(y_s, x)
        return ir, x_s, y_s, weights

    data = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    reference = _run(*build(), data)
    ir, x_s, y_s, weights = build()
    summary = outline_ir(ir, min_savings=0, min_ops=2)
    verify_ir(ir)
    assert len(summary.graphs) == 1  # the blocks, lined up where no call's items are cut off
    calls = [n for n in ir.main_graph.fx.nodes if n.target.__class__ is CallTarget
             and n.target.graph is summary.graphs[0]]
    assert len(calls) == 3
    y, _ = _run(ir, x_s, y_s, weights, data)
    np.testing.assert_array_equal(y, reference[0])
