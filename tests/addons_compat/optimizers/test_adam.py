"""popxl.addons' optimiser package: ``AdamOptimizerStep`` against torch's AdamW over steps, and
upstream's module paths for the optimisers and transforms."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat.optimizers.adam import AdamOptimizerStep
from ipuxl.errors import InvalidArgumentError

rng = np.random.default_rng(0)


def test_adam_optimizer_step_matches_torch_adamw_over_steps():
    steps, lr, wd = 5, 0.01, 0.1
    x_np = rng.standard_normal((steps, 4, 5)).astype(np.float32)
    labels = rng.integers(0, 3, (steps, 4)).astype(np.int32)
    w0 = rng.standard_normal((5, 3)).astype(np.float32)
    ir = ipuxl.Ir()
    ir.num_host_transfers = 1  # one step per run
    with ir.main_graph, ipuxl.in_sequence():
        x_stream = ipuxl.h2d_stream((4, 5), ipuxl.float32, "x")
        y_stream = ipuxl.h2d_stream((4,), ipuxl.int32, "y")
        w = ipuxl.variable(w0, name="w")
        x = ops.host_load(x_stream)
        graph = ir.create_graph(lambda x, w: x @ w, x, w)
        fwd = ops.call_with_info(graph, x, w)
        _, dlogits = addons.cross_entropy_with_grad(fwd.outputs[0], ops.host_load(y_stream))
        grad_info = ipuxl.transforms.autodiff(graph)
        _, dw = ops.call(grad_info.graph, dlogits, inputs_dict=grad_info.inputs_dict(fwd))
        facts, opt = AdamOptimizerStep().create_graph(w, w.spec, lr=lr, weight_decay=wd,
                                                       first_order_dtype=ipuxl.float32)
        opt.bind(facts.init()).call(w, dw)
    with ipuxl.Session(ir, "cpu") as session:
        for step in range(steps):
            session.run({x_stream: x_np[step], y_stream: labels[step]})
    w_t = torch.tensor(w0, requires_grad=True)
    torch_opt = torch.optim.AdamW([w_t], lr=lr, weight_decay=wd, eps=1e-5)
    for step in range(steps):
        torch_opt.zero_grad()
        F.cross_entropy(torch.from_numpy(x_np[step]) @ w_t, torch.from_numpy(labels[step]).long()).backward()
        torch_opt.step()
    assert_close(torch.from_numpy(session.get_tensor_data(w)), w_t.detach(), rtol=1e-4, atol=1e-5)


def test_optimizer_and_transform_packages_keep_upstreams_module_paths():
    from ipuxl.addons_compat.optimizers import AdamOptimizerStep as step, SGDUpdate
    from ipuxl.addons_compat.transforms.autodiff import autodiff, autodiff_with_accumulation

    assert step is AdamOptimizerStep and SGDUpdate is ipuxl.optim.SGDUpdate
    assert (autodiff, autodiff_with_accumulation) == (addons.autodiff, addons.autodiff_with_accumulation)
    with pytest.raises(InvalidArgumentError, match="global_norm_max"):
        ir = ipuxl.Ir()
        with ir.main_graph:
            w = ipuxl.variable(np.zeros(2, np.float32), name="w")
            AdamOptimizerStep().create_graph(w, w.spec, lr=0.1, global_norm=ipuxl.constant(1.0))
