"""Graph optimiser Modules train a small MLP exactly like torch.optim."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl import optim
from ipuxl.errors import InvalidArgumentError

STEPS, BATCH = 10, 4


class MLP(addons.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = addons.Linear(8)
        self.fc2 = addons.Linear(3)

    def build(self, x):
        return self.fc2(ops.tanh(self.fc1(x)))


def _train_ipuxl(optimizer, hyper, data, labels):
    np.random.seed(0)
    ir = ipuxl.Ir()  # one step per run (num_host_transfers = 1): STEPS runs
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((BATCH, 5), ipuxl.float32, "x")
        y_stream = ipuxl.h2d_stream((BATCH,), ipuxl.int32, "y")
        x, y = ops.host_load(x_stream), ops.host_load(y_stream)
        facts, fwd = MLP().create_graph(x)
        bwd = addons.autodiff(fwd)
        variables = facts.init()
        fwd_info = fwd.bind(variables).call_with_info(x)
        _, dx = addons.ops.cross_entropy_with_grad(fwd_info.outputs[0], y)
        bwd_info = bwd.call_with_info(dx, args=bwd.grad_graph_info.inputs_dict(fwd_info))
        grads = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(fwd_info, bwd_info)
        state = optim.apply_optimizer(optimizer, variables, grads, **hyper)
    session = ipuxl.Session(ir, "cpu")
    initial = {k: session.get_tensor_data(t).copy() for k, t in variables.named_tensors.items()}
    with session:
        for step in range(STEPS):
            session.run({x_stream: data[step], y_stream: labels[step]})
    trained = {k: session.get_tensor_data(t) for k, t in variables.named_tensors.items()}
    return initial, trained, state, ir


def _train_torch(initial, make, data, labels):
    w = {k: torch.tensor(v, requires_grad=True) for k, v in initial.items()}
    opt = make(list(w.values()))
    for step in range(STEPS):
        h = torch.tanh(torch.from_numpy(data[step]) @ w["fc1.weight"] + w["fc1.bias"])
        loss = F.cross_entropy(h @ w["fc2.weight"] + w["fc2.bias"], torch.from_numpy(labels[step]).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in w.items()}


CASES = [
    (optim.SGDUpdate, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (optim.SGDUpdate, dict(lr=0.1, momentum=0.9, nesterov=True),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
    (optim.AdamUpdate, dict(lr=0.01, weight_decay=0.01), lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01)),
    (optim.AdamWUpdate, dict(lr=0.01, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    (optim.RMSpropUpdate, dict(lr=0.01, momentum=0.5, centered=True),
     lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True)),
]


@pytest.mark.parametrize("module, hyper, make", CASES, ids=["sgd", "sgd-nesterov", "adam", "adamw", "rmsprop"])
def test_optimizer_module_matches_torch_optim(module, hyper, make):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((STEPS, BATCH, 5)).astype(np.float32)
    labels = rng.integers(0, 3, (STEPS, BATCH)).astype(np.int32)
    initial, trained, _, _ = _train_ipuxl(module(), hyper, data, labels)
    expected = _train_torch(initial, make, data, labels)
    for name, value in expected.items():
        assert_close(torch.from_numpy(trained[name]), value, rtol=1e-4, atol=1e-5)
        assert not np.allclose(trained[name], initial[name])


def test_one_graph_per_weight_spec_and_state_per_variable():
    rng = np.random.default_rng(1)
    data = rng.standard_normal((STEPS, BATCH, 5)).astype(np.float32)
    labels = rng.integers(0, 3, (STEPS, BATCH)).astype(np.int32)
    _, _, state, ir = _train_ipuxl(optim.AdamUpdate(first_order_dtype=ipuxl.float16), dict(lr=0.01), data, labels)
    adam_graphs = [g for g in ir.graphs if g.base_name == "AdamUpdate"]
    assert len(adam_graphs) == 4  # four distinct weight shapes: (5, 8), (8,), (8, 3), (3,)
    assert sorted(state.to_dict()) == sorted(f"{v}.{s}" for v in ("fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight")
                                             for s in ("first_order", "second_order", "step"))
    assert state.fc1.weight.first_order.dtype == torch.float16


def test_optimizer_asked_to_update_a_tensor_without_gradient():
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.zeros(3, np.float32), name="w")
        v = ipuxl.variable(np.zeros(3, np.float32), name="v")
        with pytest.raises(InvalidArgumentError, match=r"no gradient for variables \['v'\]"):
            optim.apply_optimizer(optim.SGDUpdate(), addons.NamedTensors(w=w, v=v), {w: w}, lr=0.1)
