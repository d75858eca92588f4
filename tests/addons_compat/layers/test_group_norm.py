"""popxl.addons' ``GroupNorm`` layer: forward and gradients against eager torch."""
from __future__ import annotations

import numpy as np
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons

rng = np.random.default_rng(0)


def test_group_norm_forward_and_gradients_match_torch():
    x_np = rng.standard_normal((2, 6, 3, 3)).astype(np.float32)
    dy_np = rng.standard_normal((2, 6, 3, 3)).astype(np.float32)
    torch_layer = torch.nn.GroupNorm(3, 6)
    with torch.no_grad():
        torch_layer.weight.uniform_(0.5, 1.5)
        torch_layer.bias.uniform_(-0.5, 0.5)
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.constant(x_np, name="x")
        facts, graph = addons.GroupNorm(3).create_graph(x)
        bwd = addons.autodiff(graph, grads_required=list(graph.args.tensors))
        variables = facts.init()
        info = graph.bind(variables).call_with_info(x)
        grads_info = bwd.call_with_info(ipuxl.constant(dy_np, name="dy"), args=bwd.grad_graph_info.inputs_dict(info))
        grads = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(info, grads_info)
        streams = [addons.host_store(t) for t in (info.outputs[0], grads[variables.weight], grads[variables.bias])]
    with ipuxl.Session(ir, "cpu") as session:
        session.write_variables_data(addons.GroupNorm.torch_mapping(variables, torch_layer))
        y, dw, db = (torch.from_numpy(a) for a in map(session.run().__getitem__, streams))
    x_t = torch.from_numpy(x_np)
    y_t = torch_layer(x_t)
    y_t.backward(torch.from_numpy(dy_np))
    assert_close(y, y_t.detach(), rtol=1e-5, atol=1e-5)
    assert_close(dw, torch_layer.weight.grad, rtol=1e-4, atol=1e-5)
    assert_close(db, torch_layer.bias.grad, rtol=1e-4, atol=1e-5)
