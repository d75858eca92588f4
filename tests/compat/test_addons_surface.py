"""popxl.addons names beyond the tutorial's: streams, host transfers, array munging, GroupNorm,
seeds, replica groupings, testing utilities, TaskSession and the optimiser package.

numpy and eager torch are the oracles; each behaviour is upstream's (graphcore/popxl-addons).
"""
from __future__ import annotations

import logging
import os
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat import array_munging as am
from ipuxl.addons_compat.named_replica_grouping import get_instance_replica_grouping, is_cross_instance
from ipuxl.addons_compat.optimizers.adam import AdamOptimizerStep
from ipuxl.addons_compat.task_session import TaskSession
from ipuxl.addons_compat.testing_utils import TensorInput, run_module
from ipuxl.errors import CheckpointError, InvalidArgumentError, InvalidValueError, ReplicationError

rng = np.random.default_rng(0)


# -- array_munging ----------------------------------------------------------------------------
def test_shard_splits_an_axis_onto_a_new_first_axis_and_unshard_undoes_it():
    x = np.arange(24).reshape(4, 6)
    assert_close(torch.from_numpy(am.shard(x, 2, 0)), torch.from_numpy(np.stack([x[:2], x[2:]])))
    assert_close(torch.from_numpy(am.shard(x, 3, -1)), torch.from_numpy(np.stack([x[:, :2], x[:, 2:4], x[:, 4:]])))
    for axis in (0, 1, -1):
        np.testing.assert_array_equal(am.unshard(am.shard(x, 2, axis), axis), x)
    s2 = am.shard2D(x, 2, 3, 0, 1)  # axis 0 outermost: (rows 0-1, cols 0-1), (rows 0-1, cols 2-3), ...
    np.testing.assert_array_equal(s2[1], x[:2, 2:4])
    np.testing.assert_array_equal(s2[3], x[2:, :2])
    np.testing.assert_array_equal(am.unshard2D(s2, 2, 3, 0, 1), x)
    with pytest.raises(ValueError, match="same rank"):
        am.unshard_arrays([np.zeros((1, 2)), np.zeros((1, 2, 3))], 0)
    with pytest.raises(ValueError, match="2 \\* 2 = 4 shards"):
        am.unshard2D(s2, 2, 2, 0, 1)


def test_repeats_pads_and_squeezes():
    x = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(am.repeat(x, 2, 1), np.stack([x, x], axis=1))
    np.testing.assert_array_equal(am.repeat_axis(x, 2, 0), np.concatenate([x, x], axis=0))
    np.testing.assert_array_equal(am.repeat_axis(x, 2, 1), np.concatenate([x, x], axis=1))
    data = np.arange(4)
    np.testing.assert_array_equal(am.repeat_shard(data, 2, 2, 0), [[0, 1], [2, 3], [0, 1], [2, 3]])
    np.testing.assert_array_equal(am.repeat_shard(data, 2, 2, 0, "strided"), [[0, 1], [0, 1], [2, 3], [2, 3]])
    with pytest.raises(ValueError, match="'contiguous' or 'strided'"):
        am.repeat_shard(data, 2, 2, 0, "diagonal")
    np.testing.assert_array_equal(am.pad_axis(x, 5, 1, value=-1), np.pad(x, [(0, 0), (0, 2)], constant_values=-1))
    assert am.squeeze_safe(np.zeros((1, 3, 1)), [0, 1]).shape == (3, 1)
    assert am.squeeze_safe(np.zeros((1, 3, 1))).shape == (3,)
    assert am.handle_negative_axis(x, -1) == 1
    with pytest.raises(IndexError, match="out of range"):
        am.handle_negative_axis(x, 2)
    with pytest.raises(IndexError, match="0-dimensional"):
        am.handle_negative_axis(np.float32(1.0), 0)


@pytest.mark.parametrize("tp, rf", [(1, 2), (2, 2), (2, 4)])
def test_tensor_parallel_input_gives_a_tp_group_one_sample_and_output_reads_it_back(tp, rf):
    samples = np.arange(8 * 3).reshape(8, 3)
    laid_out = am.tensor_parallel_input(samples, tp, rf)
    dp = rf // tp
    expected = np.repeat(samples.reshape(-1, dp, 1, 3), tp, axis=2).reshape(-1, rf, 3)
    np.testing.assert_array_equal(laid_out, expected)
    back = am.tensor_parallel_output(laid_out, laid_out.shape[0], tp, rf, (3,))
    np.testing.assert_array_equal(back, samples)
    with pytest.raises(ValueError, match="does not equally divide"):
        am.tensor_parallel_input(samples, 3, 4)


# -- streams and host transfers -----------------------------------------------------------------
def test_input_and_output_streams_by_name():
    ir = ipuxl.Ir()
    with ir.main_graph:
        inputs = addons.InputStreams(x=((2, 3), ipuxl.float32), n=((2,), ipuxl.int32))
        outputs = addons.OutputStreams(y=((2, 3), ipuxl.float32))
        y = ops.host_load(inputs.x) * 2.0 + ops.cast(ops.host_load(inputs.n), ipuxl.float32).reshape((2, 1))
        ops.host_store(outputs.y, y)
        again = addons.InputStreams.from_streams([inputs.x, inputs.n])
    assert list(inputs) == ["x", "n"] and inputs.x.shape == (2, 3) and inputs.n.dtype == ipuxl.int32
    assert again.x is inputs.x and again.n is inputs.n
    with pytest.raises(AttributeError, match="No attribute 'z'. Available Keys:\n    x\n    n"):
        inputs.z
    with pytest.raises(InvalidArgumentError, match="expected HostToDeviceSt"):
        addons.InputStreams.from_streams([outputs.y])
    x = rng.standard_normal((2, 3)).astype(np.float32)
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run({inputs.x: x, inputs.n: np.array([1, 2], np.int32)})
    assert_close(torch.from_numpy(out[outputs.y]), torch.from_numpy(x) * 2 + torch.tensor([[1.0], [2.0]]))


def test_top_level_host_load_host_store_and_cross_entropy():
    logits_host = rng.standard_normal((4, 5))  # float64 host data: host_load casts it to the dtype
    labels = np.array([0, 3, 1, 4], np.int32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        data, stream, logits = addons.host_load(logits_host, ipuxl.float32, "logits")
        loss = addons.cross_entropy(logits, ipuxl.constant(labels, name="labels"))
        loss_stream = addons.host_store(loss)
    assert data.dtype == np.float32 and stream.name == "logits_stream" and stream.shape == (4, 5)
    assert loss_stream.name == f"{loss.name}_stream" and loss_stream.shape == ()
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run({stream: data})[loss_stream]
    expected = F.cross_entropy(torch.from_numpy(data), torch.from_numpy(labels).long())
    assert_close(torch.tensor(out), expected)


# -- GroupNorm ---------------------------------------------------------------------------------
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


# -- seeds and replica groupings ------------------------------------------------------------------
def test_seed_variable_shares_a_seed_within_each_replica_group():
    ir = ipuxl.Ir(replication=4)
    tp_group = ir.replica_grouping(group_size=2)
    with ir.main_graph:
        seed_v, seed = addons.seed_variable(1984, tp_group)
        d2h = ipuxl.d2h_stream(seed.shape, seed.dtype, "seed")
        ops.host_store(d2h, seed)
    assert seed.shape == (2,) and seed.dtype == ipuxl.uint32
    with ipuxl.Session(ir, "cpu") as session:
        output = session.run()[d2h].reshape(2, 2, 2)  # (group, replica in group, seed)
    for a, b in output:
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(output[0, 0], output[1, 0])
    np.testing.assert_array_equal(session.get_tensor_data(seed_v), output[:, 0, :])
    np.testing.assert_array_equal(output[:, 0, :], ipuxl.create_seeds(1984, replicas=2))


def test_named_replica_grouping_and_instance_groupings(monkeypatch):
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        groups = addons.NamedReplicaGrouping.build_groups(["fc.weight", "fc.bias"], ir.replica_grouping(group_size=2))
        everyone = addons.NamedReplicaGrouping.build_groups(["w"])
        assert groups.fc.weight.group_size == 2 and sorted(groups.to_dict()) == ["fc.bias", "fc.weight"]
        assert everyone.w.group_size == 4
        strided = ir.replica_grouping(stride=2, group_size=2)
        assert not is_cross_instance(strided)  # one process runs all 4 replicas
        assert get_instance_replica_grouping(strided) is strided
        monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: 2 replicas per process
        assert is_cross_instance(strided) and not is_cross_instance(ir.replica_grouping(group_size=2))
        within = get_instance_replica_grouping(ir.replica_grouping(group_size=4))
        assert (within.stride, within.group_size) == (1, 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    wide = ipuxl.Ir(replication=8)  # 2 replicas per process
    with wide.main_graph, pytest.raises(ReplicationError, match="stride must be < ir.instance_replication_factor"):
        get_instance_replica_grouping(wide.replica_grouping(stride=4, group_size=2))


# -- testing_utils and TaskSession ------------------------------------------------------------------
def test_run_module_runs_a_layer_with_given_weights():
    x_np = rng.standard_normal((3, 4)).astype(np.float32)
    torch_linear = torch.nn.Linear(4, 2)
    (y,) = run_module(addons.Linear(2), TensorInput(x_np, ipuxl.float32),
                      weights=lambda v: {v.weight: torch_linear.weight.detach().numpy().T,
                                         v.bias: torch_linear.bias.detach().numpy()})
    assert_close(torch.from_numpy(y), torch_linear(torch.from_numpy(x_np)).detach())
    (z,) = run_module(addons.Linear(2, bias=False), TensorInput(x_np))  # dtype from the data
    assert z.shape == (3, 2) and z.dtype == np.float32


def _task_session(seed: int, max_checkpoints: int = 1) -> TaskSession:
    np.random.seed(seed)
    ir = ipuxl.Ir()
    with ir.main_graph:
        inputs = addons.InputStreams(x=((2, 4), ipuxl.float32))
        x = ops.host_load(inputs.x)
        facts, graph = addons.Linear(3).create_graph(x)
        variables = facts.init()
        (y,) = graph.bind(variables).call(x)
        outputs = addons.OutputStreams(y=((2, 3), ipuxl.float32))
        ops.host_store(outputs.y, y)
    return TaskSession(inputs, [outputs.y], variables, max_checkpoints, ir=ir, device_desc="cpu")


class _Loader:
    """A data loader with the state interface TaskSession checkpoints (save, resume)."""

    def __init__(self):
        self.position = 0

    def save(self, filename):
        np.save(filename + ".npy", np.array(self.position))
        os.replace(filename + ".npy", filename)

    def resume(self, filename):
        self.position = int(np.load(filename))


def test_task_session_checkpoints_and_copies_variables_by_name(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)  # upstream keeps checkpoint paths relative to the working directory
    first, second = _task_session(0), _task_session(1)
    assert isinstance(second.outputs, addons.OutputStreams) and second.outputs.y.shape == (2, 3)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    first.dataloader = loader = _Loader()
    loader.position = 7
    with first:
        first.run({first.inputs.x: x})
        first.add_session_state_info({"epoch": 2})
        first.save_checkpoint("ckpt/step_1")
    assert sorted(os.listdir(tmp_path / "ckpt/step_1")) == ["dataloader.bin", "model", "session_info.json"]
    assert sorted(os.listdir(tmp_path / "ckpt/step_1/model")) == ["bias.npz", "weight.npz"]
    second.dataloader = resumed = _Loader()
    with second:
        before = second.run({second.inputs.x: x})[second.outputs.y]
        second.load_checkpoint("ckpt/step_1")
        after = second.run({second.inputs.x: x})[second.outputs.y]
    with first:
        expected = first.run({first.inputs.x: x})[first.outputs.y]
    assert not np.allclose(before, expected)
    assert_close(torch.from_numpy(after), torch.from_numpy(expected))
    assert resumed.position == 7 and second.session_state == {"steps": 2, "epoch": 2}  # steps: first's, loaded
    named = first.get_named_tensors_data()
    assert isinstance(named, addons.NamedTensorData) and set(named.keys()) == {"bias", "weight"}
    third = _task_session(2)
    third.load_from_session(first)
    for name, t in third.state.to_dict().items():
        np.testing.assert_array_equal(third.get_tensor_data(t), named.to_dict()[name])


def test_task_session_keeps_max_checkpoints_and_reports_missing_names(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    session = _task_session(0, max_checkpoints=2)
    for step in range(3):
        session.save_checkpoint(f"ckpt/{step}")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]  # the oldest is deleted
    os.remove(tmp_path / "ckpt/2/model/bias.npz")
    np.savez(tmp_path / "ckpt/2/model/extra.npz", extra=np.zeros(1))
    with pytest.raises(CheckpointError, match=r"not in state: \['extra'\].*not in checkpoint: \['bias'\]"):
        session.load_checkpoint("ckpt/2", report_missing="error")
    with caplog.at_level(logging.WARNING):
        session.load_checkpoint("ckpt/2")
    assert "state keys not in checkpoint: ['bias']" in caplog.text
    with pytest.raises(CheckpointError, match="no checkpoint in 'nowhere'"):
        session.load_checkpoint("nowhere")
    with pytest.raises(InvalidArgumentError, match="Weights & Biases"):
        session.save_checkpoint("wandb://run/model")
    with pytest.raises(InvalidValueError, match="must implement save and resume"):
        session.dataloader = object()


# -- optimisers package -------------------------------------------------------------------------------
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
