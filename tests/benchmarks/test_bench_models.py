"""The weight check of ``benchmarks/bench_models.py`` (torchvision models through
``trainingModel`` against eager), on a small BatchNorm CNN: it passes for ipuxl and it
detects a wrong weight or a wrong BatchNorm step count."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torchvision.ops import StochasticDepth

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the benchmark lives outside the package
from benchmarks import bench_models  # noqa: E402


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 10))


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(bench_models.MODELS, "small_cnn", small_cnn)
    return "small_cnn"


def test_check_weights_passes_for_ipuxl(small: str) -> None:
    err_ipu, err_eager32, ok = bench_models.check_weights(small, calls=2)
    assert ok, (err_ipu, err_eager32)
    assert 0 < err_eager32 < 1e-4  # float32 is off float64, a little, on a well-conditioned net
    assert err_ipu <= max(bench_models.FACTOR * err_eager32, bench_models.FLOOR)


def test_check_detects_wrong_weights_and_statistics(small: str) -> None:
    sides = bench_models.Sides(small, check=True)
    try:
        err_ipu, err_eager, _, _ = bench_models.weight_errors(sides, calls=1)
        states = sides.states()
    finally:
        sides.free()
    reference, ipu = states["float64"], states["ipuxl"]
    assert bench_models.passes(err_ipu, err_eager)

    bad = dict(ipu, **{"model.1.weight": ipu["model.1.weight"] * (1 + 1e-3)})  # a BatchNorm scale 0.1% off
    err_bad, where = bench_models.relative_distance(bad, reference)
    assert where == "model.1.weight" and err_bad == pytest.approx(1e-3, rel=0.05)
    assert not bench_models.passes(err_bad, err_eager)

    stale = dict(ipu, **{"model.4.running_var": states["eager"]["model.4.running_var"] * 0.9})
    assert not bench_models.passes(bench_models.relative_distance(stale, reference)[0], err_eager)

    steps = dict(ipu, **{"model.4.num_batches_tracked": ipu["model.4.num_batches_tracked"] + 1})
    assert bench_models.relative_distance(steps, reference) == (math.inf, "model.4.num_batches_tracked")


def test_relative_distance_floors_noise_around_zero() -> None:
    reference = {"bias": torch.full((16,), 1e-17, dtype=torch.float64)}  # an exact-zero gradient's noise
    err, _ = bench_models.relative_distance({"bias": torch.full((16,), 3e-8)}, reference)
    assert err == pytest.approx(3e-8 / bench_models.RMS_FLOOR)
    err, _ = bench_models.relative_distance({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, 1.0])})
    assert err == pytest.approx(1 / math.sqrt(2))


def test_build_turns_dropout_and_stochastic_depth_off() -> None:
    model = bench_models.build("efficientnet_b0")
    regularisers = [m for m in model.modules() if isinstance(m, (nn.Dropout, StochasticDepth))]
    assert any(isinstance(m, StochasticDepth) for m in regularisers) and regularisers
    assert all(m.p == 0 for m in regularisers)
    assert set(bench_models.MODELS) >= {"resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_large", "vit",
                                        "swin_t", "googlenet", "mnasnet1_0", "regnet_y_400mf", "densenet121"}


def test_one_ulp_away_moves_every_weight_by_one_float32_ulp() -> None:
    model = small_cnn()
    before = [p.detach().clone() for p in model.parameters()]
    moved = bench_models.one_ulp_away(model)
    for old, new in zip(before, moved.parameters()):
        up = torch.nextafter(old, torch.full_like(old, math.inf))
        down = torch.nextafter(old, torch.full_like(old, -math.inf))
        assert torch.all((new == up) | (new == down)) and not torch.equal(new, old)
        assert 0.3 < (new == up).float().mean().item() < 0.7 or old.numel() < 20
