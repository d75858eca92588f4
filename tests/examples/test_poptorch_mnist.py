"""Seed 003 (PopTorch CNN): 3 epochs reach >= 97.5% on the offline split, within 1 point of eager
PyTorch trained with the same dropout masks (DropoutReplay)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import load_example

DATA = Path(os.environ.get("IPUXL_DATA", Path(__file__).resolve().parents[3] / "shared" / "datasets"))
needs_data = pytest.mark.skipif(not (DATA / "MNIST" / "raw").exists(), reason="MNIST not available")


@needs_data
@pytest.mark.slow
def test_poptorch_mnist_three_epochs(capsys):
    result = load_example("poptorch_mnist").main(["--data-dir", str(DATA), "--epochs", "3", "--compare-eager"])
    assert result.accuracy >= 97.5
    assert abs(result.accuracy - result.eager_accuracy) <= 1.0
    out = capsys.readouterr().out
    assert "Accuracy on test set" in out and "Eager PyTorch accuracy on test set (the device's dropout masks)" in out
    assert "training on the first 8000 test images" in out or "train /" in out
