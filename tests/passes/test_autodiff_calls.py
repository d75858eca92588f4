"""autodiff of a graph that calls subgraphs: each callee is differentiated once and stays
called (forward and backward), as PopXL does; eager PyTorch is the oracle."""
from __future__ import annotations

import numpy as np
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl import transforms
from ipuxl.ir.calls import CallTarget, RepeatTarget
from ipuxl.ir.verify import verify_ir

F64 = ipuxl.float64
DEPTH = 4


def _block(x, w, b):
    return x + ops.tanh(x @ w + b) * 0.5


def _block_torch(x, w, b):
    return x + torch.tanh(x @ w + b) * 0.5


def _calls(graph) -> list:
    return [n.target.graph for n in graph.fx.nodes if isinstance(n.target, CallTarget)]


def _aten_ops(graph) -> int:
    return sum(1 for n in graph.fx.nodes if isinstance(n.target, torch._ops.OpOverload))


def _build(rng, repeat_body: bool = False):
    x, dy = rng.standard_normal((5, 6)), rng.standard_normal((5, 6))
    ws = [rng.standard_normal((6, 6)) * 0.4 for _ in range(DEPTH)]
    bs = [rng.standard_normal(6) * 0.1 for _ in range(DEPTH)]
    ir = ipuxl.Ir()
    with ir.main_graph:
        xs = ipuxl.h2d_stream(x.shape, F64, "x")
        loaded = ops.host_load(xs)
        wv = [ipuxl.variable(w, F64, name=f"w{i}") for i, w in enumerate(ws)]
        bv = [ipuxl.variable(b, F64, name=f"b{i}") for i, b in enumerate(bs)]
        block = ir.create_graph(_block, loaded, wv[0], bv[0])

        def net(h, *params):
            for i in range(DEPTH):
                h, = ops.call(block, h, params[2 * i], params[2 * i + 1])
            return h

        flat = [t for pair in zip(wv, bv) for t in pair]
        fwd = ir.create_graph(net, loaded, *flat)
        call_info = ops.call_with_info(fwd, loaded, *flat)
        infos = transforms.autodiff(fwd, return_all_grad_graphs=True)
        verify_ir(ir)
        info = infos[fwd]
        grads = ops.call(info.graph, ipuxl.constant(dy, F64), inputs_dict=info.inputs_dict(call_info))
        streams = [ipuxl.d2h_stream(g.shape, g.dtype, f"g{i}") for i, g in enumerate(grads)]
        out = ipuxl.d2h_stream((5, 6), F64, "out")
        ops.host_store(out, call_info.outputs[0])
        for s, g in zip(streams, grads):
            ops.host_store(s, g)
    verify_ir(ir)
    with ipuxl.Session(ir, "cpu") as session:
        results = session.run({xs: x})
    # eager
    xt = torch.tensor(x, requires_grad=True)
    params = [torch.tensor(a, requires_grad=True) for pair in zip(ws, bs) for a in pair]
    h = xt
    for i in range(DEPTH):
        h = _block_torch(h, params[2 * i], params[2 * i + 1])
    ref = torch.autograd.grad(h, [xt, *params], torch.tensor(dy))
    return ir, block, fwd, infos, results[out], [results[s] for s in streams], h.detach(), ref


def test_called_graph_is_differentiated_once_and_stays_called():
    ir, block, fwd, infos, out, grads, ref_out, ref_grads = _build(np.random.default_rng(0))
    assert_close(torch.from_numpy(out), ref_out)
    assert len(grads) == len(ref_grads) == 1 + 2 * DEPTH
    for g, r in zip(grads, ref_grads):
        assert_close(torch.from_numpy(g), r)
    # the forward still calls the block DEPTH times and holds none of its ops
    assert _calls(fwd) == [block] * DEPTH
    assert _aten_ops(fwd) == 0
    # the grad graph calls the block's grad graph DEPTH times; the block got one grad graph
    assert block in infos
    block_grad = infos[block].graph
    assert _calls(infos[fwd].graph).count(block_grad) == DEPTH
    assert not any(isinstance(t, CallTarget) for t in [n.target for n in block_grad.fx.nodes])
    # the block gained outputs for the activations its grad graph reads (PopXL's behaviour)
    assert len(block.outputs) > 1
    assert [e.fwd_tensor for e in infos[block].expected_inputs if e.connection_type.name == "Fwd"]


def test_loop_body_is_traced_through():
    rng = np.random.default_rng(1)
    x, w, dy = rng.standard_normal((3, 4)), rng.standard_normal((4, 4)) * 0.5, rng.standard_normal((3, 4))
    ir = ipuxl.Ir()
    with ir.main_graph:
        xs = ipuxl.h2d_stream(x.shape, F64, "x")
        loaded = ops.host_load(xs)
        weight = ipuxl.variable(w, F64, name="w")
        body = ir.create_graph(lambda h, w: ops.tanh(h @ w), loaded, weight)
        fwd = ir.create_graph(lambda h, w: ops.repeat(body, 3, h, w)[0], loaded, weight)
        call_info = ops.call_with_info(fwd, loaded, weight)
        info = transforms.autodiff(fwd)
        verify_ir(ir)
        grads = ops.call(info.graph, ipuxl.constant(dy, F64), inputs_dict=info.inputs_dict(call_info))
        streams = [ipuxl.d2h_stream(g.shape, g.dtype, f"g{i}") for i, g in enumerate(grads)]
        for s, g in zip(streams, grads):
            ops.host_store(s, g)
    verify_ir(ir)
    with ipuxl.Session(ir, "cpu") as session:
        results = session.run({xs: x})
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    h = xt
    for _ in range(3):
        h = torch.tanh(h @ wt)
    ref = torch.autograd.grad(h, [xt, wt], torch.tensor(dy))
    for s, r in zip(streams, ref):
        assert_close(torch.from_numpy(results[s]), r)
    assert len(body.outputs) == 1  # a loop body is not rewritten
    assert not any(isinstance(n.target, RepeatTarget) for n in fwd.fx.nodes)


def _mixed_ipuxl(block, x, w, b):
    h0 = x * 2.0
    h1, = ops.call(block, h0, w, b)
    s = h1 + ops.tanh(x)
    h2, = ops.call(block, s, w, b)
    h3, = ops.call(block, h2 * h1, w, b)  # h1 read by two later units: its gradients are summed
    return h3 * 0.5 + h1, ops.reduce_sum(h2)


def _mixed_torch(x, w, b):
    h0 = x * 2.0
    h1 = _block_torch(h0, w, b)
    h2 = _block_torch(h1 + torch.tanh(x), w, b)
    h3 = _block_torch(h2 * h1, w, b)
    return h3 * 0.5 + h1, h2.sum()


def test_ops_between_calls_fan_out_and_several_outputs():
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((3, 6)), rng.standard_normal((6, 6)) * 0.3, rng.standard_normal(6) * 0.1
    dy0, dy1 = rng.standard_normal((3, 6)), rng.standard_normal(())
    ir = ipuxl.Ir()
    with ir.main_graph:
        xs = ipuxl.h2d_stream(x.shape, F64, "x")
        loaded = ops.host_load(xs)
        wv, bv = ipuxl.variable(w, F64, name="w"), ipuxl.variable(b, F64, name="b")
        block = ir.create_graph(_block, loaded, wv, bv)
        fwd = ir.create_graph(lambda x, w, b: _mixed_ipuxl(block, x, w, b), loaded, wv, bv)
        call_info = ops.call_with_info(fwd, loaded, wv, bv)
        info = transforms.autodiff(fwd, grads_required=[fwd.inputs[0], fwd.inputs[1]])  # not b
        verify_ir(ir)
        grads = ops.call(info.graph, ipuxl.constant(dy0, F64), ipuxl.constant(dy1, F64),
                         inputs_dict=info.inputs_dict(call_info))
        streams = [ipuxl.d2h_stream(g.shape, g.dtype, f"g{i}") for i, g in enumerate(grads)]
        for s, g in zip(streams, grads):
            ops.host_store(s, g)
    verify_ir(ir)
    with ipuxl.Session(ir, "cpu") as session:
        results = session.run({xs: x})
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    y0, y1 = _mixed_torch(xt, wt, bt)
    ref = torch.autograd.grad([y0, y1], [xt, wt], [torch.tensor(dy0), torch.tensor(dy1)])
    assert len(streams) == 2
    for s, r in zip(streams, ref):
        assert_close(torch.from_numpy(results[s]), r)
    assert _calls(fwd).count(block) == 3
    assert _aten_ops(fwd) == 0  # the ops between the calls moved into graphs of their own, called once


def test_an_explicit_gradient_without_a_path_is_refused_between_calls():
    import pytest
    from ipuxl.errors import AutodiffError

    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.ones((2, 6)), F64, name="x")
        w, b = ipuxl.variable(np.eye(6), F64, name="w"), ipuxl.variable(np.zeros(6), F64, name="b")
        unused = ipuxl.variable(np.ones(6), F64, name="unused")
        block = ir.create_graph(_block, x, w, b)

        def net(x, w, b, unused):
            h, = ops.call(block, x, w, b)
            h, = ops.call(block, h, w, b)
            return h, unused * 2.0

        fwd = ir.create_graph(net, x, w, b, unused)
        with pytest.raises(AutodiffError, match="no differentiable path"):
            transforms.autodiff(fwd, grads_provided=[fwd.outputs[0]], grads_required=[fwd.inputs[3]])
