"""Seed 001 (PopXL MNIST) trains exactly like eager PyTorch."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
from ipuxl.errors import StreamInputError

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


def test_num_host_transfers_larger_than_the_loads_uses_the_first_slices(popxl_mnist, caplog):
    """The tutorial loads each stream once per run: as PopART's step IO does, with
    num_host_transfers = 5 a run still runs the step once, on the first slice of the data,
    and ipuxl logs that the other slices are unused (the device loop form is
    ``ops.repeat`` of a step graph that loads its batch, tests/device)."""
    rng = np.random.default_rng(1)
    images = rng.standard_normal((5, BATCH, 28, 28)).astype(np.float32)
    labels = rng.integers(0, 10, (5, BATCH)).astype(np.int32)
    trained = []
    for transfers, data in ((5, (images, labels)), (1, (images[0], labels[0]))):
        torch.manual_seed(0)
        np.random.seed(0)
        ir, streams, loss_stream, params = popxl_mnist.build_train_ir(BATCH, LR)
        ir.num_host_transfers = transfers
        with caplog.at_level(logging.WARNING, logger="ipuxl"), ipuxl.Session(ir, "cpu") as session:
            session.run(dict(zip(streams, data)))
            trained.append(session.get_tensors_data(params.values()))
    assert "no stream is transferred 5 times per run" in caplog.text
    for (name, five), one in zip(trained[0].items(), trained[1].values()):
        assert_close(torch.from_numpy(five), torch.from_numpy(one))  # one step, on the first slice


DATA = Path(os.environ.get("IPUXL_DATA", Path(__file__).resolve().parents[3] / "shared" / "datasets"))


@pytest.mark.skipif(not (DATA / "MNIST" / "raw").exists(), reason="MNIST not available")
def test_example_reaches_90_percent_and_tracks_eager(popxl_mnist, capsys):
    result = popxl_mnist.main(["--data-dir", str(DATA), "--epochs", "1", "--compare-eager"])
    assert result.accuracy >= 90.0
    assert abs(result.accuracy - result.eager_accuracy) <= 1.0
    out = capsys.readouterr().out
    assert "Test accuracy" in out and "Eager PyTorch test accuracy" in out
