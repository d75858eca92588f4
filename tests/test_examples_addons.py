"""Seeds 002 and 004 train MNIST to >= 90% on the offline split, within 1 point of eager PyTorch."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import load_example

DATA = Path(os.environ.get("IPUXL_DATA", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
needs_data = pytest.mark.skipif(not (DATA / "MNIST" / "raw").exists(), reason="MNIST not available")


@needs_data
@pytest.mark.parametrize("example, flags", [
    ("addons_mnist", []),
    ("addons_mnist", ["--outlined"]),
    ("custom_optimiser_mnist", []),
], ids=["addons-inlined", "addons-outlined", "custom-adam"])
def test_example_reaches_90_percent_and_tracks_eager(example, flags, capsys):
    result = load_example(example).main(["--data-dir", str(DATA), "--compare-eager", *flags])
    assert result.accuracy >= 90.0
    assert abs(result.accuracy - result.eager_accuracy) <= 1.0
    out = capsys.readouterr().out
    assert "Test accuracy" in out and "Eager PyTorch test accuracy" in out
