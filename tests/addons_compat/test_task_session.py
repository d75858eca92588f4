"""popxl.addons' ``TaskSession``: checkpoints, variables copied by name, at most ``max_checkpoints``."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat.task_session import TaskSession
from ipuxl.errors import CheckpointError, InvalidArgumentError, InvalidValueError

rng = np.random.default_rng(0)


def _task_session(seed: int, max_checkpoints: int = 1, memmap_dir: str | None = None) -> TaskSession:
    np.random.seed(seed)
    ir = ipuxl.Ir()
    with ir.main_graph:
        inputs = addons.InputStreams(x=((2, 4), ipuxl.float32))
        x = ops.host_load(inputs.x)
        facts, graph = addons.Linear(3).create_graph(x)
        variables = facts.init(memmap_dir=memmap_dir)
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


def test_load_checkpoint_skip_memmap_keeps_the_values_of_memory_mapped_variables(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = _task_session(0)
    with source:
        source.save_checkpoint("ckpt")
    saved = {k: v.copy() for k, v in source.get_tensors_data(source.state.tensors).items()}
    mapped = _task_session(1, memmap_dir=str(tmp_path / "weights"))
    in_files = {k: v.copy() for k, v in mapped.get_tensors_data(mapped.state.tensors).items()}
    with mapped:
        mapped.load_checkpoint("ckpt", skip_memmap=True)
        for t in mapped.state.tensors:
            np.testing.assert_array_equal(mapped.get_tensor_data(t), in_files[t])
        mapped.load_checkpoint("ckpt")
        for name, t in mapped.state.to_dict().items():
            np.testing.assert_array_equal(mapped.get_tensor_data(t), saved[source.state.to_dict()[name]])
    assert not np.array_equal(in_files[mapped.state.weight], saved[source.state.weight])  # the test can tell
    np.testing.assert_array_equal(np.fromfile(tmp_path / "weights" / "weight.npy", np.float32).reshape(4, 3),
                                  saved[source.state.weight])  # the loaded values went to the file
