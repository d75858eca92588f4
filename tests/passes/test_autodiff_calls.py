"""autodiff of a graph that calls subgraphs: each callee is differentiated once and stays
called (forward and backward), as PopXL does; eager PyTorch is the oracle."""
from __future__ import annotations

import numpy as np
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl import transforms
from ipuxl.ir.lower import CallTarget, RepeatTarget

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
        info = infos[fwd]
        grads = ops.call(info.graph, ipuxl.constant(dy, F64), inputs_dict=info.inputs_dict(call_info))
        streams = [ipuxl.d2h_stream(g.shape, g.dtype, f"g{i}") for i, g in enumerate(grads)]
        out = ipuxl.d2h_stream((5, 6), F64, "out")
        ops.host_store(out, call_info.outputs[0])
        for s, g in zip(streams, grads):
            ops.host_store(s, g)
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
        grads = ops.call(info.graph, ipuxl.constant(dy, F64), inputs_dict=info.inputs_dict(call_info))
        streams = [ipuxl.d2h_stream(g.shape, g.dtype, f"g{i}") for i, g in enumerate(grads)]
        for s, g in zip(streams, grads):
            ops.host_store(s, g)
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
