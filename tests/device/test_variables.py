"""``ipuxl.device.variables``: host buffers made on first use, and variables whose initial
data the IR keeps without a copy (``ipuxl.ir.graph_builder.given_variable``)."""
from __future__ import annotations

import copy

import numpy as np
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.ir.graph_builder import given_variable


def _doubler(initial: np.ndarray):
    """``w *= 2`` once per run."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(initial, name="w")
        ops.var_updates.copy_var_update_(w, w * 2.0)
    return ir, w


def test_a_session_makes_no_host_buffer_until_one_is_used():
    initial = np.arange(4, dtype=np.float32)
    ir, w = _doubler(initial)
    session = ipuxl.Session(ir, "ipu_model")
    with session:
        session.run()
        assert len(session._variables.host) == 0  # attached and run: no second host copy yet
    # detaching reads the device back: the buffer now exists and holds the device's value
    assert len(session._variables.host) == 1
    assert_close(session.get_tensor_data(w), initial * 2)


def test_an_unmade_buffer_counts_as_the_initial_value_and_a_write_makes_it():
    initial = np.arange(4, dtype=np.float32)
    ir, w = _doubler(initial)
    session = ipuxl.Session(ir, "ipu_model")
    assert_close(session.get_tensor_data(w), initial)  # read before any run: the initial value
    session.write_variable_data(w, np.full(4, 3.0, np.float32))
    with session:
        session.run()
    assert_close(session.get_tensor_data(w), np.full(4, 6.0, np.float32))
    second = ipuxl.Session(ir, "ipu_model")  # the IR's initial value is untouched by the first session
    with second:
        second.run()
    assert_close(second.get_tensor_data(w), initial * 2)


def test_given_arrays_are_kept_and_others_copied():
    ir = ipuxl.Ir()
    kept, strided, other = np.zeros((3, 4), np.float32), np.zeros((4, 3), np.float32).T, np.zeros(3, np.float64)
    with ir.main_graph:
        a = given_variable(kept, torch.float32, "a")
        b = given_variable(strided, torch.float32, "b")
        c = given_variable(other, torch.float32, "c")
    data = {r.tensor: r.data for r in ir.variable_records.values()}
    assert data[a] is kept
    assert not np.shares_memory(data[b], strided) and not np.shares_memory(data[c], other)
    assert data[c].dtype == np.float32


def test_poptorch_programs_start_from_the_host_weights_without_copying_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    eager = copy.deepcopy(model)

    class WithLoss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            out = self.net(x)
            return out, torch.nn.functional.cross_entropy(out, y)

    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    ipu = ipuxl.trainingModel(WithLoss(model), ipuxl.Options().deviceIterations(2),
                              optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))
    ipu(x, y)
    records = ipu.session.ir.variable_records.values()
    weight = model[0].weight.detach().numpy()
    assert any(np.shares_memory(r.data, weight) for r in records)
    opt = torch.optim.AdamW(eager.parameters(), lr=0.1)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(eager(xs), ys).backward()
        opt.step()
    for p, q in zip(model.parameters(), eager.parameters()):  # reading the host weights syncs them
        assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    ipu(x, y)  # the program keeps training from the device's weights
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(eager(xs), ys).backward()
        opt.step()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
