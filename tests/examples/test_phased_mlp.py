"""examples/phased_mlp.py (#17): phased execution with RTS fits where the plain program
does not, and trains to the same weights as the plain program and as eager PyTorch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.conftest import load_example

# A 2 MiB simulated IPU: the plain program (4 x 256^2 weights, Adam state on-chip)
# needs ~3.8 MiB, the phased one ~1 MiB (one layer's weights on-chip at a time).
ARGS = ["--hidden", "256", "--layers", "4", "--steps", "2", "--ipu-memory-mib", "2"]


@pytest.fixture(scope="module")
def example():
    return load_example("phased_mlp")


@pytest.fixture(scope="module")
def result(example):
    return example.main(ARGS)


def test_only_the_phased_program_fits_and_its_report_shows_the_peak_under_the_limit(result, capsys):
    assert result["plain_fits"] is False and result["phased_fits"] is True
    memory = result["report"].memory
    assert memory.total_bytes <= memory.available_bytes == 2 * 2 ** 20
    assert memory.variable_bytes < 1024  # only the Adam step counters stay on-chip
    assert memory.remote_buffer_bytes > memory.total_bytes  # weights + Adam state live off-chip
    assert result["report"].remote_per_run.loaded_bytes > 0 and result["report"].remote_per_run.stored_bytes > 0


def test_phased_training_matches_the_plain_program(result, example):
    assert result["plain"].keys() == result["phased"].keys()
    for name, value in result["plain"].items():
        assert_close(result["phased"][name], value, msg=name)
    initial = example._init_weights(example.Config(hidden=256, layers=4))
    assert not np.allclose(result["phased"]["layer0.weight"], initial[0])  # it trained


def test_plain_program_matches_eager_pytorch_data_parallel_adam(result, example):
    """Two replicas each take a micro-batch; their mean gradient is the gradient of the
    mean loss over both; Adam (eps=1e-5, bias corrected) as torch.optim.Adam."""
    cfg = example.Config(hidden=256, layers=4, steps=2)
    weights = [torch.tensor(w, requires_grad=True) for w in example._init_weights(cfg)]
    biases = [torch.zeros(cfg.hidden, requires_grad=True) for _ in weights]
    optimiser = torch.optim.Adam([*weights, *biases], lr=cfg.lr, eps=1e-5)
    x, labels = example._data(cfg)
    for step in range(cfg.steps):
        optimiser.zero_grad()
        losses = []
        for replica in range(cfg.replicas):
            h = torch.from_numpy(x[step, replica])
            for w, b in zip(weights, biases):
                h = F.gelu(h @ w + b, approximate="tanh")  # PopXL's gelu
            losses.append(F.cross_entropy(h, torch.from_numpy(labels[step, replica]).long()))
        torch.stack(losses).mean().backward()
        optimiser.step()
    for i, (w, b) in enumerate(zip(weights, biases)):
        assert_close(result["plain"][f"layer{i}.weight"], w.detach().numpy(), atol=1e-5, rtol=1e-4)
        assert_close(result["plain"][f"layer{i}.bias"], b.detach().numpy(), atol=1e-5, rtol=1e-4)
