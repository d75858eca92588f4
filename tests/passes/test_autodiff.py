"""transforms.autodiff against torch.autograd.grad (eager PyTorch is the oracle)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl import transforms
from ipuxl.errors import AutodiffError
from ipuxl.ir.verify import verify_ir

F64 = ipuxl.float64


def _run_grads(fn, inputs: list[np.ndarray], dy: np.ndarray, grads_required_idx=None):
    """Build fn as a subgraph, autodiff it, call fwd + grad from main; return (outputs, grads)."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        streams = [ipuxl.h2d_stream(a.shape, F64, f"in{i}") for i, a in enumerate(inputs)]
        loaded = [ops.host_load(s) for s in streams]
        graph = ir.create_graph(fn, *loaded)
        call_info = ops.call_with_info(graph, *loaded)
        required = None if grads_required_idx is None else [graph.inputs[i] for i in grads_required_idx]
        info = transforms.autodiff(graph, grads_required=required)
        verify_ir(ir)
        dy_stream = ipuxl.h2d_stream(dy.shape, F64, "dy")
        grads = ops.call(info.graph, ops.host_load(dy_stream), inputs_dict=info.inputs_dict(call_info))
        out = call_info.outputs[0]
        out_stream = ipuxl.d2h_stream(out.shape, out.dtype, "out")
        ops.host_store(out_stream, out)
        grad_streams = []
        for i, g in enumerate(grads):
            grad_streams.append(ipuxl.d2h_stream(g.shape, g.dtype, f"grad{i}"))
            ops.host_store(grad_streams[-1], g)
    verify_ir(ir)
    feeds = dict(zip(streams, inputs))
    feeds[dy_stream] = dy
    with ipuxl.Session(ir, "cpu") as session:
        results = session.run(feeds)
    return results[out_stream], [results[s] for s in grad_streams], info


def _torch_grads(fn, inputs, dy, idx=None):
    xs = [torch.tensor(a, requires_grad=True) for a in inputs]
    out = fn(*xs)
    wanted = xs if idx is None else [xs[i] for i in idx]
    return out.detach(), torch.autograd.grad(out, wanted, torch.tensor(dy))


def _mlp_ipuxl(x, w0, b0, w1, b1):
    h = ops.gelu(x @ w0 + b0)
    return ops.softmax(ops.tanh(h @ w1 + b1), axis=-1)


def _mlp_torch(x, w0, b0, w1, b1):
    h = F.gelu(x @ w0 + b0, approximate="tanh")
    return torch.softmax(torch.tanh(h @ w1 + b1), dim=-1)


def _mlp_inputs(rng):
    return [rng.standard_normal(s) for s in [(5, 6), (6, 4), (4,), (4, 3), (3,)]]


def test_mlp_gradients_equal_autograd():
    rng = np.random.default_rng(0)
    inputs, dy = _mlp_inputs(rng), rng.standard_normal((5, 3))
    out, grads, _ = _run_grads(_mlp_ipuxl, inputs, dy)
    ref_out, ref_grads = _torch_grads(_mlp_torch, inputs, dy)
    assert_close(torch.from_numpy(out), ref_out)
    assert len(grads) == 5
    for g, r in zip(grads, ref_grads):
        assert_close(torch.from_numpy(g), r)


def test_grads_required_subset_returns_only_those_in_order():
    rng = np.random.default_rng(1)
    inputs, dy = _mlp_inputs(rng), rng.standard_normal((5, 3))
    _, grads, info = _run_grads(_mlp_ipuxl, inputs, dy, grads_required_idx=[3, 1])
    _, ref_grads = _torch_grads(_mlp_torch, inputs, dy, idx=[3, 1])
    assert [g.shape for g in grads] == [(4, 3), (6, 4)]
    for g, r in zip(grads, ref_grads):
        assert_close(torch.from_numpy(g), r)
    assert [c.fwd_tensor for c in info.expected_outputs] == [info.forward_graph.inputs[3],
                                                            info.forward_graph.inputs[1]]


def _conv_ipuxl(x, w, v):
    h = ops.max_pool(ops.relu(ops.conv(x, w, padding=(1, 1, 1, 1))), (2, 2), (2, 2))
    return h.reshape((2, -1)) @ v


def _conv_torch(x, w, v):
    h = F.max_pool2d(torch.relu(F.conv2d(x, w, padding=1)), 2)
    return h.reshape(2, -1) @ v


def test_conv_like_graph_gradients_equal_autograd():
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal((36, 5))]
    dy = rng.standard_normal((2, 5))
    out, grads, _ = _run_grads(_conv_ipuxl, inputs, dy)
    ref_out, ref_grads = _torch_grads(_conv_torch, inputs, dy)
    assert_close(torch.from_numpy(out), ref_out)
    for g, r in zip(grads, ref_grads):
        assert_close(torch.from_numpy(g), r)


def test_graph_called_from_two_sites_differentiates_each_call():
    rng = np.random.default_rng(3)
    a, b, w, dy = (rng.standard_normal(s) for s in [(3, 4), (3, 4), (4, 2), (3, 2)])
    ir = ipuxl.Ir()
    with ir.main_graph:
        sa, sb = ipuxl.h2d_stream((3, 4), F64, "a"), ipuxl.h2d_stream((3, 4), F64, "b")
        xa, xb = ops.host_load(sa), ops.host_load(sb)
        weight = ipuxl.variable(w, F64, name="w")
        graph = ir.create_graph(lambda x, w: ops.tanh(x @ w), xa, weight)
        call_a = ops.call_with_info(graph, xa, weight)
        call_b = ops.call_with_info(graph, xb, weight)
        info = transforms.autodiff(graph)
        verify_ir(ir)
        seed = ipuxl.constant(dy, F64)
        grads_a = ops.call_with_info(info.graph, seed, inputs_dict=info.inputs_dict(call_a))
        grads_b = ops.call_with_info(info.graph, seed, inputs_dict=info.inputs_dict(call_b))
        by_parent_a = info.fwd_parent_ins_to_grad_parent_outs(call_a, grads_a)
        by_parent_b = info.fwd_parent_ins_to_grad_parent_outs(call_b, grads_b)
        wanted = {"ga": by_parent_a[xa], "gwa": by_parent_a[weight], "gb": by_parent_b[xb], "gwb": by_parent_b[weight]}
        streams = {k: ipuxl.d2h_stream(t.shape, t.dtype, k) for k, t in wanted.items()}
        for k, t in wanted.items():
            ops.host_store(streams[k], t)
    verify_ir(ir)
    with ipuxl.Session(ir, "cpu") as session:
        results = session.run({sa: a, sb: b})
    for x_np, gx, gw in [(a, "ga", "gwa"), (b, "gb", "gwb")]:
        x_t, w_t = torch.tensor(x_np, requires_grad=True), torch.tensor(w, requires_grad=True)
        ref = torch.autograd.grad(torch.tanh(x_t @ w_t), [x_t, w_t], torch.tensor(dy))
        assert_close(torch.from_numpy(results[streams[gx]]), ref[0])
        assert_close(torch.from_numpy(results[streams[gw]]), ref[1])


def _ops_of(graph) -> list[str]:
    names = []
    for node in graph.fx.nodes:
        if node.op == "call_function":
            target = node.target
            names.append(target.overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload)
                         else getattr(target, "__name__", str(target)))
    return names


def test_backward_does_not_recompute_the_forward():
    ir = ipuxl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(_mlp_ipuxl, *[ipuxl.TensorSpec(s, ipuxl.float32)
                                             for s in [(5, 6), (6, 4), (4,), (4, 3), (3,)]])
        n_outputs_before = len(graph.outputs)
        info = transforms.autodiff(graph)
    verify_ir(ir)
    backward = _ops_of(info.graph)
    # Forward ops of the MLP: 2 matmuls, gelu, tanh, softmax. The backward may use
    # matmuls for the 4 weight/input gradients but none of the forward activations.
    assert "gelu" not in backward and "tanh" not in backward and "_softmax" not in backward
    assert backward.count("mm") == 4
    assert {"gelu_backward", "tanh_backward", "_softmax_backward_data"} <= set(backward)
    # The activations come from the forward graph, which gained outputs for them.
    assert len(graph.outputs) > n_outputs_before
    fwd_kinds = [c.connection_type for c in info.expected_inputs]
    assert fwd_kinds[0] is transforms.ExpectedConnectionType.FwdGrad
    assert transforms.ExpectedConnectionType.Fwd in fwd_kinds[1:]
    saved_outputs = [c.fwd_tensor for c in info.expected_inputs[1:] if c.fwd_tensor in graph.outputs]
    assert saved_outputs, "saved activations must be forward outputs"


def test_required_gradient_without_a_path_raises():
    ir = ipuxl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(lambda x, unused: ops.exp(x), ipuxl.TensorSpec((2,), ipuxl.float32),
                                ipuxl.TensorSpec((2,), ipuxl.float32))
        with pytest.raises(AutodiffError, match="'unused' has no differentiable path"):
            transforms.autodiff(graph, grads_required=[graph.inputs[1]])


def test_detach_stops_the_gradient_path():
    ir = ipuxl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(lambda x: ops.detach(x) * 2.0, ipuxl.TensorSpec((2,), ipuxl.float32))
        with pytest.raises(AutodiffError, match="no differentiable path"):
            transforms.autodiff(graph, grads_required=[graph.inputs[0]])


def test_inputs_dict_rejects_a_call_of_another_graph():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.ones(2, np.float32), name="x")
        g1 = ir.create_graph(lambda t: ops.exp(t), x)
        g2 = ir.create_graph(lambda t: ops.log(t), x)
        info = transforms.autodiff(g1)
        with pytest.raises(AutodiffError, match="'g2'|lambda"):
            info.inputs_dict(ops.call_with_info(g2, x))
