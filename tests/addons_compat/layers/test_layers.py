"""addons layers equal their torch.nn.functional counterparts, forward and gradient."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops

rng = np.random.default_rng(0)


def _run(module, x_np, x_dtype=ipuxl.float32):
    """Forward and the gradients of sum(y * dy) w.r.t. every named input; returns (y, {name: grad}, weights)."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        stream = ipuxl.h2d_stream(x_np.shape, x_dtype, "x")
        x = ops.host_load(stream)
        facts, graph = module.create_graph(x)
        bwd = addons.autodiff(graph, grads_required=list(graph.args.to_dict().values()))
        variables = facts.init()
        info = graph.bind(variables).call_with_info(x)
        y = info.outputs[0]
        dy = ipuxl.constant(rng.standard_normal(y.shape).astype(np.float32), name="dy")
        grads_info = bwd.call_with_info(dy, args=bwd.grad_graph_info.inputs_dict(info))
        grads = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(info, grads_info)
        out = {"y": y, **{name: grads[t] for name, t in variables.named_tensors.items()}}
        streams = {k: ipuxl.d2h_stream(t.shape, t.dtype, k.replace(".", "_")) for k, t in out.items()}
        for k, t in out.items():
            ops.host_store(streams[k], t)
    session = ipuxl.Session(ir)
    weights = {k: torch.from_numpy(session.get_tensor_data(t).copy()) for k, t in variables.named_tensors.items()}
    with session:
        result = session.run({stream: x_np})
    dy_value = torch.from_numpy(graph.graph.ir.main_graph.constant_data[dy.node.target].numpy())
    return {k: torch.from_numpy(result[s]) for k, s in streams.items()}, weights, dy_value


def _check(got, weights, dy, fn, x):
    leaves = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    y = fn(x, leaves)
    grads = torch.autograd.grad(y, list(leaves.values()), dy)
    assert_close(got["y"], y.detach(), rtol=1e-5, atol=1e-5)
    for (name, _), g in zip(leaves.items(), grads):
        assert_close(got[name], g, rtol=1e-4, atol=1e-5)


def test_linear():
    x = rng.standard_normal((3, 5)).astype(np.float32)
    got, w, dy = _run(addons.Linear(4), x)
    _check(got, w, dy, lambda x, p: x @ p["weight"] + p["bias"], torch.from_numpy(x))


def test_layer_norm():
    x = rng.standard_normal((3, 6)).astype(np.float32)
    got, w, dy = _run(addons.LayerNorm(eps=1e-5), x)
    _check(got, w, dy, lambda x, p: F.layer_norm(x, (6,), p["weight"], p["bias"], 1e-5), torch.from_numpy(x))


def test_embedding():
    idx = np.array([[0, 3], [2, 3]], np.int32)
    got, w, dy = _run(addons.Embedding(ipuxl.float32, 5, 4), idx, ipuxl.int32)
    _check(got, w, dy, lambda x, p: F.embedding(x.long(), p["weight"]), torch.from_numpy(idx))


@pytest.mark.parametrize("stride, padding, groups", [(1, 0, 1), (2, 1, 1), (1, 1, 2)])
def test_conv2d(stride, padding, groups):
    x = rng.standard_normal((2, 4, 7, 7)).astype(np.float32)
    layer = addons.Conv2D(6, 3, strides=(stride, stride), paddings=(padding,) * 4, groups=groups)
    got, w, dy = _run(layer, x)
    assert w["bias"].shape == (1, 6, 1, 1)  # upstream's bias shape
    _check(got, w, dy, lambda x, p: F.conv2d(x, p["weight"], p["bias"].reshape(-1), stride, padding, 1, groups),
           torch.from_numpy(x))
