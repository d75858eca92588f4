"""``examples/pipelined_mnist.py``: seed 003's CNN pipelined over 2 IPUs learns exactly as the
same network unsplit (same weights, options and seed), and prints the per-IPU report."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import load_example

DATA = Path(os.environ.get("IPUXL_DATA", Path(__file__).resolve().parents[3] / "shared" / "datasets"))
needs_data = pytest.mark.skipif(not (DATA / "MNIST" / "raw").exists(), reason="MNIST not available")


@needs_data
@pytest.mark.slow  # about 20-35 s: two trainings and evaluations of the CNN
def test_pipelined_mnist_matches_unsplit(capsys):
    result = load_example("pipelined_mnist").main(
        ["--data-dir", str(DATA), "--train-images", "1280", "--test-images", "800", "--lr", "0.1",
         "--compare-unsplit"])
    assert result.unsplit_accuracy is not None
    assert abs(result.accuracy - result.unsplit_accuracy) <= 0.1  # the same program, placed differently
    assert result.accuracy >= 40.0  # 4 calls of 320 images: 40 SGD steps learn (chance is 10%)
    out = capsys.readouterr().out
    assert "Pipeline: 3 stages x 4 micro-batches" in out and "stage 1 (IPU 1)" in out
    assert "Accuracy on test set (2 IPUs, pipelined)" in out and "Accuracy on test set (unsplit, 1 IPU)" in out
