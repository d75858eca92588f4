"""``addons_compat.autodiff``, ``autodiff_with_accumulation`` and the cross entropy ops
against eager PyTorch (autograd, ``F.cross_entropy``, ``torch.optim.SGD``).

The training step is seed 002's ``train_program`` verbatim (``popxl`` -> ``ipuxl``,
device ``cpu``), fed MNIST-shaped random data.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl as popxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops


from tests.addons_compat.seed002 import Net  # noqa: E402  (seed 002, verbatim)


def train_program(batch_size, device, learning_rate):
    ir = popxl.Ir(replication=1)

    with ir.main_graph:
        # Create input streams from host to device
        img_stream = popxl.h2d_stream((batch_size, 28, 28), popxl.float32, "image")
        img_t = ops.host_load(img_stream)  # load data
        label_stream = popxl.h2d_stream((batch_size,), popxl.int32, "labels")
        labels = ops.host_load(label_stream, "labels")

        # Create forward graph
        facts, fwd_graph = Net().create_graph(img_t)
        # Create backward graph via autodiff transform
        bwd_graph = addons.autodiff(fwd_graph)

        # Initialise variables (weights)
        variables = facts.init()

        # Call the forward graph with call_with_info because we want to retrieve
        # information from the call site
        fwd_info = fwd_graph.bind(variables).call_with_info(img_t)
        x = fwd_info.outputs[0]  # forward output

        # Compute loss and starting gradient for backpropagation
        loss, dx = addons.ops.cross_entropy_with_grad(x, labels)

        # Setup a stream to retrieve loss values from the host
        loss_stream = popxl.d2h_stream(loss.shape, loss.dtype, "loss")
        ops.host_store(loss_stream, loss)

        # retrieve activations from the forward graph
        activations = bwd_graph.grad_graph_info.inputs_dict(fwd_info)
        # call the backward graph providing the starting value for backpropagation and activations
        bwd_info = bwd_graph.call_with_info(dx, args=activations)

        # Optimiser: get a mapping between forward tensors and corresponding
        # gradients and use it to update each tensor
        grads_dict = bwd_graph.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(
            fwd_info, bwd_info
        )
        for t in variables.tensors:
            ops.scaled_add_(t, grads_dict[t], b=-learning_rate)

    ir.num_host_transfers = 1
    return popxl.Session(ir, device), [img_stream, label_stream], variables, loss_stream


def _torch_net(w: dict[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    x = images.reshape(-1, 28 * 28)
    for i in (1, 2, 3):
        x = F.gelu(x @ w[f"fc{i}.weight"] + w[f"fc{i}.bias"], approximate="tanh")  # PopXL's gelu is tanh
    return x @ w["fc4.weight"] + w["fc4.bias"]


# -- training step --------------------------------------------------------------------------
def test_seed002_train_program_equals_eager_sgd_after_five_steps():
    batch, lr, steps = 8, 0.05, 5
    np.random.seed(0)
    session, streams, variables, loss_stream = train_program(batch, "cpu", lr)
    initial = {k: session.get_tensor_data(t).copy() for k, t in variables.named_tensors.items()}
    assert list(initial) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "fc3.bias", "fc3.weight",
                             "fc4.bias", "fc4.weight"]  # init's sorted order
    weights = {k: torch.tensor(v, requires_grad=True) for k, v in initial.items()}
    optimizer = torch.optim.SGD(list(weights.values()), lr=lr)
    rng = np.random.default_rng(0)
    with session:
        for _ in range(steps):
            images = rng.standard_normal((batch, 28, 28)).astype(np.float32)
            labels = rng.integers(0, 10, batch).astype(np.int32)
            loss = session.run(dict(zip(streams, [images, labels])))[loss_stream]
            optimizer.zero_grad()
            ref_loss = F.cross_entropy(_torch_net(weights, torch.from_numpy(images)), torch.from_numpy(labels).long())
            ref_loss.backward()
            optimizer.step()
            assert_close(torch.tensor(loss), ref_loss.detach())
    final = session.get_tensors_data(variables.tensors)
    for name, t in variables.named_tensors.items():
        ref = weights[name].detach()
        assert_close(torch.from_numpy(final[t]), ref, rtol=1e-5, atol=1e-7)
        moved = np.abs(final[t] - initial[name]).max()
        assert moved > 1e-5, f"{name} did not train"


def test_autodiff_grad_graph_info_connects_forward_and_backward():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros((2, 28, 28), np.float32), name="x")
        facts, fwd_graph = Net().create_graph(x)
        bwd_graph = addons.autodiff(fwd_graph)
        variables = facts.init()
        fwd_info = fwd_graph.bind(variables).call_with_info(x)
        info = bwd_graph.grad_graph_info
        assert isinstance(bwd_graph, addons.GraphWithNamedArgs) and bwd_graph.graph is info.graph
        assert info.forward_graph is fwd_graph.graph
        # gradients of every forward input: the image and the 8 named inputs
        assert set(info.outputs) == set(fwd_graph.graph.inputs)
        dx = popxl.constant(np.ones((2, 10), np.float32))
        bwd_info = bwd_graph.call_with_info(dx, args=info.inputs_dict(fwd_info))
        grads = info.fwd_parent_ins_to_grad_parent_outs(fwd_info, bwd_info)
        assert set(grads) == {x, *variables.tensors}
        assert all(grads[t].shape == t.shape for t in grads)


# -- cross entropy ------------------------------------------------------------------------------------
def _run_cross_entropy(logits: np.ndarray, targets: np.ndarray, **kwargs):
    ir = popxl.Ir()
    with ir.main_graph:
        x_stream = popxl.h2d_stream(logits.shape, popxl.float32, "x")
        t_stream = popxl.h2d_stream(targets.shape, popxl.int32, "t")
        x, t = ops.host_load(x_stream), ops.host_load(t_stream)
        scaling = kwargs.pop("loss_scaling", 1)
        if isinstance(scaling, str):  # a tensor loss scale, fed at run time
            scaling = popxl.variable(np.float32(float(scaling)), popxl.float32, name="loss_scaling")
        loss, dx = addons.ops.cross_entropy_with_grad(x, t, loss_scaling=scaling, **kwargs)
        plain = addons.ops.cross_entropy(x, t, **kwargs)
        streams = {name: popxl.d2h_stream(v.shape, v.dtype, name) for name, v in
                   [("loss", loss), ("dx", dx), ("plain", plain)]}
        for name, v in [("loss", loss), ("dx", dx), ("plain", plain)]:
            ops.host_store(streams[name], v)
    with popxl.Session(ir, "cpu") as session:
        out = session.run({x_stream: logits, t_stream: targets})
    return {name: torch.from_numpy(out[s]) for name, s in streams.items()}


def _torch_cross_entropy(logits: np.ndarray, targets: np.ndarray, ignore_index: int = -100):
    x = torch.tensor(logits, requires_grad=True)
    loss = F.cross_entropy(x.reshape(-1, x.shape[-1]), torch.from_numpy(targets).long().reshape(-1),
                           ignore_index=ignore_index)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


@pytest.mark.parametrize("loss_scaling", [1, 128.0, "64"], ids=["none", "float", "tensor"])
def test_cross_entropy_with_grad_equals_torch_and_scales_only_the_gradient(loss_scaling):
    rng = np.random.default_rng(5)
    logits = (3 * rng.standard_normal((3, 4, 7))).astype(np.float32)  # (*dims, C)
    targets = rng.integers(0, 7, (3, 4)).astype(np.int32)
    out = _run_cross_entropy(logits, targets, loss_scaling=loss_scaling)
    ref_loss, ref_grad = _torch_cross_entropy(logits, targets)
    scale = float(loss_scaling)
    assert out["loss"].shape == () and out["dx"].shape == logits.shape
    assert_close(out["loss"], ref_loss)  # NOT scaled
    assert_close(out["dx"], ref_grad * scale)
    assert_close(out["plain"], ref_loss)


def test_cross_entropy_ignore_index_rows_contribute_nothing():
    rng = np.random.default_rng(6)
    logits = (3 * rng.standard_normal((6, 5))).astype(np.float32)
    targets = np.array([1, 4, 2, 4, 0, 3], np.int32)
    out = _run_cross_entropy(logits, targets, loss_scaling=8.0, ignore_index=4)
    ref_loss, ref_grad = _torch_cross_entropy(logits, targets, ignore_index=4)
    assert_close(out["loss"], ref_loss)  # mean over the 4 counted rows
    assert_close(out["plain"], ref_loss)
    assert_close(out["dx"], ref_grad * 8.0)
    assert (out["dx"][[1, 3]] == 0).all()
    # changing the logits of ignored rows changes nothing
    changed = logits.copy()
    changed[[1, 3]] = 100 * rng.standard_normal((2, 5))
    again = _run_cross_entropy(changed, targets, loss_scaling=8.0, ignore_index=4)
    for name in ("loss", "dx", "plain"):
        assert_close(again[name], out[name])
    # and differs from counting them
    counted, _ = _torch_cross_entropy(logits, targets)
    assert not torch.allclose(out["loss"], counted)


def test_cross_entropy_equals_torch():
    rng = np.random.default_rng(7)
    logits = (5 * rng.standard_normal((16, 10))).astype(np.float32)
    targets = rng.integers(0, 10, 16).astype(np.int32)
    out = _run_cross_entropy(logits, targets)
    assert_close(out["plain"], F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(targets).long()))


# -- autodiff_with_accumulation -----------------------------------------------------------------------
class _MLP(addons.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = addons.Linear(16)
        self.fc2 = addons.Linear(4)

    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        return self.fc2(ops.gelu(self.fc1(x)))


def test_autodiff_with_accumulation_keeps_running_mean_of_gradients():
    batch, features, calls = 6, 8, 3
    ir = popxl.Ir()
    with ir.main_graph:
        x_stream = popxl.h2d_stream((batch, features), popxl.float32, "x")
        label_stream = popxl.h2d_stream((batch,), popxl.int32, "labels")
        x, labels = ops.host_load(x_stream), ops.host_load(label_stream)
        facts, fwd_graph = _MLP().create_graph(x)
        x_input = fwd_graph.graph.inputs[0]
        accum_facts, bwd_graph = addons.autodiff_with_accumulation(
            fwd_graph, fwd_graph.args.tensors, grads_required=[x_input])
        variables, accum = facts.init(), accum_facts.init()
        fwd_info = fwd_graph.bind(variables).call_with_info(x)
        _, dy = addons.ops.cross_entropy_with_grad(fwd_info.outputs[0], labels)
        info = bwd_graph.grad_graph_info
        bwd_info = bwd_graph.bind(accum).call_with_info(dy, args=info.inputs_dict(fwd_info))
        # the accumulated gradients are no longer outputs: only the input's gradient is
        assert len(bwd_graph.graph.outputs) == 1 and len(bwd_info.outputs) == 1
        assert info.outputs == (x_input,)
        assert set(info.fwd_parent_ins_to_grad_parent_outs(fwd_info, bwd_info)) == {x}
        dx_stream = popxl.d2h_stream((batch, features), popxl.float32, "dx")
        ops.host_store(dx_stream, bwd_info.outputs[0])
    names = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert sorted(accum_facts.keys_flat()) == sorted(["mean_accum_counter"] + [f"accum.{n}" for n in names])
    assert bwd_graph.args.keys_flat() == accum_facts.keys_flat()
    assert all(f.by_ref for f in accum_facts.values_flat())
    session = popxl.Session(ir, "cpu")
    weights = {k: torch.from_numpy(session.get_tensor_data(t).copy()) for k, t in variables.named_tensors.items()}
    rng = np.random.default_rng(8)
    grads = []
    with session:
        for k in range(1, calls + 1):
            xd = rng.standard_normal((batch, features)).astype(np.float32)
            ld = rng.integers(0, 4, batch).astype(np.int32)
            dx = session.run({x_stream: xd, label_stream: ld})[dx_stream]
            w = {n: v.clone().requires_grad_(True) for n, v in weights.items()}
            xt = torch.tensor(xd, requires_grad=True)
            y = F.gelu(xt @ w["fc1.weight"] + w["fc1.bias"], approximate="tanh") @ w["fc2.weight"] + w["fc2.bias"]
            g = torch.autograd.grad(F.cross_entropy(y, torch.from_numpy(ld).long()), [xt, *w.values()])
            grads.append(dict(zip(w, g[1:])))
            assert_close(torch.from_numpy(dx), g[0])
            assert session.get_tensor_data(accum.mean_accum_counter) == np.float32(k)
            for name in names:
                mean = torch.stack([gr[name] for gr in grads]).mean(0)
                assert_close(torch.from_numpy(session.get_tensor_data(accum.to_dict()[f"accum.{name}"])), mean)
        # resetting the counter restarts the mean
        session.write_variable_data(accum.mean_accum_counter, 0.0)
        session.run({x_stream: xd, label_stream: ld})
        for name in names:
            assert_close(torch.from_numpy(session.get_tensor_data(accum.to_dict()[f"accum.{name}"])),
                         grads[-1][name])
    assert (session.get_tensor_data(variables.fc1.weight) == weights["fc1.weight"].numpy()).all()  # no optimiser
