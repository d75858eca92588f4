"""PyTorch Lightning's IPU strategy (lightning-graphcore 0.1.0, pytorch-lightning 2.0.6) on ipuxl.

Each test runs a Lightning program (``lightning_programs.py``) in the Lightning venv
(``_client_venv``: ``import poptorch`` works there as on an IPU machine) and compares
what it saved with the same training in eager PyTorch: the weights after ``fit``, the
losses of every validation and test step, and the predictions. Lightning's own
``Trainer(accelerator="ipu")`` (pytorch-lightning 2.0's built-in IPU support) runs the
same program.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from tests.poptorch_compat.clients._client_venv import client_python, run_client

PYTHON, PROBLEM = client_python("lightning")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")]
PROGRAMS = Path(__file__).with_name("lightning_programs.py")


def _regression_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g)
    return x, x @ torch.randn(8, 2, generator=g) + 0.1


def _run(tmp_path: Path, scenario: str, *options: str) -> dict:
    out = tmp_path / "result.pt"
    run_client(PYTHON, PROGRAMS, scenario, str(out), *options)
    return torch.load(out)


def _eager_regression(before: dict, rows_per_step: int) -> tuple[torch.nn.Linear, list[torch.Tensor]]:
    """SGD (lr 0.05, momentum 0.9) on the mean loss of each step's rows, in order; and each step's loss."""
    model = torch.nn.Linear(8, 2)
    model.load_state_dict({k.removeprefix("layer."): v for k, v in before.items()})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _regression_data(1)
    losses = []
    for start in range(0, len(x), rows_per_step):
        loss = torch.nn.functional.mse_loss(model(x[start:start + rows_per_step]), y[start:start + rows_per_step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return model, losses


def _per_call_losses(model: torch.nn.Linear, seed: int, parts: int) -> list[torch.Tensor]:
    """Each evaluation call's losses, one per 4-row part of the call's batch (a replica's
    batch in one device iteration), as ipuxl returns them: a scalar for one part."""
    x, y = _regression_data(seed)
    rows = 4 * parts
    with torch.no_grad():
        out = [torch.stack([torch.nn.functional.mse_loss(model(x[s + 4 * r:s + 4 * r + 4]), y[s + 4 * r:s + 4 * r + 4])
                            for r in range(parts)]) for s in range(0, len(x), rows)]
    return [o[0] if parts == 1 else o for o in out]


def _check_regression(result: dict, replicas: int, rows_per_step: int, iterations: int = 1) -> None:
    eager, losses = _eager_regression(result["before"], rows_per_step)
    assert_close({k.removeprefix("layer."): v for k, v in result["after"].items()}, eager.state_dict(),
                 rtol=1e-5, atol=1e-6)
    # fit validates once after its epoch, then trainer.validate again: both with the trained weights
    val = _per_call_losses(eager, 2, replicas * iterations)
    assert_close(result["outputs"]["validate"], val + val, rtol=1e-5, atol=1e-6)
    assert_close(result["outputs"]["test"], _per_call_losses(eager, 3, replicas * iterations), rtol=1e-5, atol=1e-6)
    x, _ = _regression_data(4)
    with torch.no_grad():
        assert_close(torch.cat(result["predictions"]), eager(x), rtol=1e-5, atol=1e-6)
    if rows_per_step == 4 * replicas:  # one step per call: each call's loss is that step's
        train = [t if replicas == 1 else t.mean() for t in result["outputs"]["train"]]
        assert_close(train, losses, rtol=1e-5, atol=1e-6)


def test_fit_validate_test_predict_match_eager_training(tmp_path):
    result = _run(tmp_path, "regression")
    assert result["accelerator"] == "lightning_graphcore.accelerator" and result["replication_factor"] == 1
    _check_regression(result, replicas=1, rows_per_step=4)


def test_two_devices_are_two_replicas_fed_by_a_poptorch_dataloader(tmp_path):
    result = _run(tmp_path, "regression", "--devices", "2", "--poptorch-loader")
    assert result["replication_factor"] == 2
    _check_regression(result, replicas=2, rows_per_step=8)


def test_device_iterations_and_gradient_accumulation(tmp_path):
    # with one device Lightning 2.0 leaves a module's torch DataLoader as it is (it converts
    # for several devices): the module returns poptorch.DataLoaders built with the strategy's options
    result = _run(tmp_path, "regression", "--device-iterations", "2", "--accumulate", "2", "--poptorch-loader")
    # each optimizer step accumulates two 4-row micro-batches; two steps run per device call
    _check_regression(result, replicas=1, rows_per_step=8, iterations=2)


def test_lightnings_builtin_ipu_accelerator(tmp_path):
    result = _run(tmp_path, "regression", "--builtin")
    assert result["accelerator"] == "pytorch_lightning.accelerators.ipu"
    _check_regression(result, replicas=1, rows_per_step=4)


def _eager_classifier(before: dict, dtype: torch.dtype, epochs: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(dtype)
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    y = torch.arange(96) % 3
    x = (torch.randn(96, 4, generator=g) * 0.3 + torch.eye(3, 4)[y] * 2).to(dtype)
    for _ in range(epochs):
        for s in range(0, 96, 8):
            loss = torch.nn.functional.cross_entropy(net(x[s:s + 8]), y[s:s + 8])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net


@pytest.mark.parametrize("half", [False, True], ids=["32-true", "16-mixed"])
def test_classifier_with_user_options_learns_as_eager(tmp_path, half):
    result = _run(tmp_path, "classifier", *(["--half"] if half else []))
    assert result["options"] == (True, True)  # the strategy used the options objects it was given
    dtype = torch.float16 if half else torch.float32
    eager = _eager_classifier(result["before"], dtype, epochs=3)
    # float16: the same float16 SGD as eager, up to float16 rounding of ~36 steps
    tol = dict(rtol=2e-2, atol=2e-2) if half else dict(rtol=1e-4, atol=1e-5)
    assert_close({k.removeprefix("net."): v for k, v in result["after"].items()}, eager.state_dict(), **tol)
    last_epoch_accuracy = torch.stack(result["outputs"]["validate"][-4:]).float().mean()
    assert last_epoch_accuracy > 0.95
