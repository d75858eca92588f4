"""Graphcore's PopTorch pipelining tutorial (../shared/reference/pytorch_pipelining) runs unchanged
through ``python -m ipuxl.compat``, with both of its strategies.

As ``test_popxl_data_parallelism``: the program reads MNIST with torchvision from
``~/.torch/datasets``, so each run gets a HOME whose ``MNIST/raw`` holds images of the
real test set (offline, the training images are not available), cut short: one
training call (40 x 10 accumulated x 10 iterations = 4000 images) and one test call
(8 x 100 iterations = 800 images).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reference.test_popxl_data_parallelism import ACCURACY, DATA, LOSS, make_mnist_home
from tests.conftest import ROOT

PROGRAM = ROOT.parent / "shared" / "reference" / "pytorch_pipelining" / "mnist_pipeline.py"
needs_program = pytest.mark.skipif(
    not (DATA / "t10k-images-idx3-ubyte.gz").exists() or not PROGRAM.exists(),
    reason="MNIST test set or the reference program not available")
TRAIN_IMAGES, TEST_IMAGES = 4000, 800


@pytest.fixture(scope="module")
def mnist_home(tmp_path_factory) -> Path:
    return make_mnist_home(tmp_path_factory.mktemp("home"), TRAIN_IMAGES, TEST_IMAGES)


def _run(home: Path, *args: str) -> tuple[float, list[float]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # this tree's ipuxl
    env.update(HOME=str(home), OMP_NUM_THREADS="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-m", "ipuxl.compat", str(PROGRAM), "--epochs", "1", *args],
                          env=env, cwd=home, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = [float(v) for v in LOSS.findall(proc.stderr)]
    (accuracy,) = [float(v) for v in ACCURACY.findall(proc.stdout)]
    return accuracy, losses


@needs_program
@pytest.mark.slow  # about 30 s: two runs of the program, each in its own process
def test_pipelined_and_sharded_strategies_learn_the_same(mnist_home):
    """4 stages on 4 IPUs, AdamW: one call of 10 steps learns (chance is 10%). The sharded run
    has no gradient accumulation, so each step takes one micro-batch of 400 instead of 10 of
    40: the same mean gradient, so both strategies reach the same weights."""
    pipelined, losses = _run(mnist_home, "--strategy", "pipelined")
    assert losses and all(math.isfinite(v) for v in losses)
    assert pipelined >= 40.0
    sharded, _ = _run(mnist_home, "--strategy", "sharded", "--offload-optimiser")
    assert abs(sharded - pipelined) <= 0.5
