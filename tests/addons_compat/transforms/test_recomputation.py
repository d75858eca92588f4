"""popxl.addons' ``recompute_graph`` (``addons_compat.transforms.recomputation``): the same gradients,
computed from the forward inputs (the forward runs again inside the gradient graph). Eager torch is
the oracle."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat.transforms.recomputation import recompute_graph
from ipuxl.ir.grad_info import ExpectedConnectionType

rng = np.random.default_rng(0)


class MLP(addons.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = addons.Linear(6), addons.Linear(3)

    def build(self, x):
        return self.fc2(ops.gelu(self.fc1(x)))


def test_recomputed_gradients_equal_torchs_and_need_only_forward_inputs():
    x_np = rng.standard_normal((4, 5)).astype(np.float32)
    labels = np.array([0, 2, 1, 2], np.int32)
    np.random.seed(0)
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.constant(x_np, name="x")
        facts, fwd = MLP().create_graph(x)
        bwd = recompute_graph(addons.autodiff(fwd))
        variables = facts.init()
        fwd_info = fwd.bind(variables).call_with_info(x)
        loss, dlogits = addons.cross_entropy_with_grad(fwd_info.outputs[0], ipuxl.constant(labels, name="y"))
        bwd_info = bwd.call_with_info(dlogits, args=bwd.grad_graph_info.inputs_dict(fwd_info))
        grads = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(fwd_info, bwd_info)
        streams = {k: addons.host_store(grads[t]) for k, t in variables.named_tensors.items()}
    info = bwd.grad_graph_info
    fwd_inputs = set(fwd.graph.inputs)
    activations = [c for c in info.expected_inputs if c.connection_type is ExpectedConnectionType.Fwd]
    assert activations and all(c.fwd_tensor in fwd_inputs for c in activations)  # no saved activations
    assert "recomp" in bwd.graph.name and len(bwd.graph.inputs) == 1 + len(fwd_inputs)
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run()
        w = {k: torch.from_numpy(session.get_tensor_data(t)).requires_grad_() for k, t in variables.named_tensors.items()}
    h = F.gelu(torch.from_numpy(x_np) @ w["fc1.weight"] + w["fc1.bias"], approximate="tanh")
    F.cross_entropy(h @ w["fc2.weight"] + w["fc2.bias"], torch.from_numpy(labels).long()).backward()
    for name, stream in streams.items():
        assert_close(torch.from_numpy(out[stream]), w[name].grad, rtol=1e-4, atol=1e-6)


def test_recomputing_an_accumulating_gradient_graph_accumulates_the_same():
    x_np = rng.standard_normal((2, 4, 5)).astype(np.float32)
    results = []
    for recompute in (False, True):
        np.random.seed(0)
        ir = ipuxl.Ir()
        with ir.main_graph, ipuxl.in_sequence():
            facts, fwd = MLP().create_graph(ipuxl.TensorSpec((4, 5), ipuxl.float32))
            accum_facts, bwd = addons.autodiff_with_accumulation(fwd, fwd.args.tensors)
            if recompute:
                bwd = recompute_graph(bwd)
            variables, accums = facts.init(), accum_facts.init()
            for step in range(2):
                x = ipuxl.constant(x_np[step], name=f"x{step}")
                fwd_info = fwd.bind(variables).call_with_info(x)
                dy = ipuxl.constant(np.ones((4, 3), np.float32), name=f"dy{step}")
                bwd.bind(accums).call(dy, args=bwd.grad_graph_info.inputs_dict(fwd_info))
        with ipuxl.Session(ir, "cpu") as session:
            session.run()
            results.append({k: session.get_tensor_data(t) for k, t in accums.named_tensors.items()})
    plain, recomputed = results
    assert sorted(plain) == sorted(recomputed) and "mean_accum_counter" in plain
    for name in plain:
        assert_close(torch.from_numpy(recomputed[name]), torch.from_numpy(plain[name]))
    assert float(plain["mean_accum_counter"]) == 2.0 and np.abs(plain["accum.fc2.weight"]).max() > 0
