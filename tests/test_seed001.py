"""Seed 001 (PopXL MNIST) trains exactly like eager PyTorch."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl

STEPS, BATCH, LR = 20, 8, 0.05


def _eager_step(weights: dict[str, torch.Tensor], x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x.reshape(-1, 784) @ weights["W0"] + weights["b0"], approximate="tanh")
    logits = F.gelu(h @ weights["W1"] + weights["b1"], approximate="tanh")
    probs = torch.softmax(logits, dim=-1)
    loss = F.nll_loss(torch.log(probs), labels.long())
    loss.backward()
    with torch.no_grad():
        for w in weights.values():
            w -= LR * w.grad
            w.grad = None
    return loss.detach()


def test_twenty_sgd_steps_match_eager(popxl_mnist):
    np.random.seed(0)
    ir, (img_stream, label_stream), loss_stream, params = popxl_mnist.build_train_ir(BATCH, LR)
    session = ipuxl.Session(ir, "ipu_model")
    initial = {v: a.copy() for v, a in session.get_tensors_data(params.values()).items()}
    eager = {k: torch.tensor(initial[v], requires_grad=True) for k, v in params.items()}

    rng = np.random.default_rng(0)
    images = rng.standard_normal((STEPS, BATCH, 28, 28)).astype(np.float32)
    labels = rng.integers(0, 10, (STEPS, BATCH)).astype(np.int32)
    with session:
        for step in range(STEPS):
            loss = session.run({img_stream: images[step], label_stream: labels[step]})[loss_stream]
            ref_loss = _eager_step(eager, torch.from_numpy(images[step]), torch.from_numpy(labels[step]))
            assert_close(torch.from_numpy(loss), ref_loss, rtol=1e-5, atol=1e-6)
    trained = session.get_tensors_data(params.values())
    for name, var in params.items():
        assert_close(torch.from_numpy(trained[var]), eager[name].detach(), rtol=1e-5, atol=1e-6)
        assert not np.allclose(trained[var], initial[var]), f"{name} did not change"


def test_num_host_transfers_runs_the_same_steps_in_one_call(popxl_mnist):
    np.random.seed(1)
    ir_one, streams_one, loss_one, params_one = popxl_mnist.build_train_ir(BATCH, LR)
    np.random.seed(1)
    ir_many, streams_many, loss_many, params_many = popxl_mnist.build_train_ir(BATCH, LR)
    ir_many.num_host_transfers = 5
    rng = np.random.default_rng(1)
    images = rng.standard_normal((5, BATCH, 28, 28)).astype(np.float32)
    labels = rng.integers(0, 10, (5, BATCH)).astype(np.int32)
    with ipuxl.Session(ir_one, "cpu") as one:
        losses_one = [one.run(dict(zip(streams_one, [images[i], labels[i]])))[loss_one] for i in range(5)]
    with ipuxl.Session(ir_many, "cpu") as many:
        losses_many = many.run(dict(zip(streams_many, [images, labels])))[loss_many]
    assert losses_many.shape == (5,)
    assert_close(torch.from_numpy(losses_many), torch.tensor(np.stack(losses_one)))
    w_one, w_many = one.get_tensors_data(params_one.values()), many.get_tensors_data(params_many.values())
    for name in params_one:
        assert_close(torch.from_numpy(w_many[params_many[name]]), torch.from_numpy(w_one[params_one[name]]))


DATA = Path(os.environ.get("IPUXL_DATA", Path(__file__).resolve().parents[2] / "shared" / "datasets"))


@pytest.mark.skipif(not (DATA / "MNIST" / "raw").exists(), reason="MNIST not available")
def test_example_reaches_90_percent_and_tracks_eager(popxl_mnist, capsys):
    result = popxl_mnist.main(["--data-dir", str(DATA), "--epochs", "1", "--compare-eager"])
    assert result.accuracy >= 90.0
    assert abs(result.accuracy - result.eager_accuracy) <= 1.0
    out = capsys.readouterr().out
    assert "Test accuracy" in out and "Eager PyTorch test accuracy" in out
