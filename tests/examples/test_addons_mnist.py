"""Seeds 002 and 004 train MNIST to >= 90% on the offline split, within 1 point of eager PyTorch."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import load_example

DATA = Path(os.environ.get("IPUXL_DATA", Path(__file__).resolve().parents[3] / "shared" / "datasets"))
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


def test_outlined_net_keeps_one_linear_graph_and_one_grad_graph_through_autodiff():
    """addons.autodiff of NetOutlined differentiates the shared Linear graph once: fc2 and
    fc3 call one forward and one grad graph (no data needed)."""
    example = load_example("addons_mnist")
    session = example.train_program(8, "cpu", 0.01, net=example.NetOutlined)[0]
    graphs = {g.name: g for g in session.report().graphs}
    assert graphs["Linear_subgraph(1)"].compiled_as == "outlined"
    assert len(graphs["Linear_subgraph(1)"].call_sites) == 2
    assert len(graphs["Linear_grad_subgraph(2)"].call_sites) == 2
