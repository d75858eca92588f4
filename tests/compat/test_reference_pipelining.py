"""Graphcore's PopTorch pipelining tutorial (../shared/reference/pytorch_pipelining) runs unchanged
through ``python -m ipuxl.compat``, with both of its strategies.

As ``test_reference_programs``: the program reads MNIST with torchvision from
``~/.torch/datasets``, so each run gets a HOME whose ``MNIST/raw`` holds images of the
real test set (offline, the training images are not available), cut short: one
training call (40 x 10 accumulated x 10 iterations = 4000 images) and one test call
(8 x 100 iterations = 800 images).
"""
from __future__ import annotations

import gzip
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

DATA = Path(os.environ.get("IPUXL_DATA", ROOT.parent / "shared" / "datasets")) / "MNIST" / "raw"
PROGRAM = ROOT.parent / "shared" / "reference" / "pytorch_pipelining" / "mnist_pipeline.py"
needs_program = pytest.mark.skipif(
    not (DATA / "t10k-images-idx3-ubyte.gz").exists() or not PROGRAM.exists(),
    reason="MNIST test set or the reference program not available")
ACCURACY = re.compile(r"Accuracy on test set: (\d+\.\d+)%")
LOSS = re.compile(r"Loss:(\d+\.\d+)")
TRAIN_IMAGES, TEST_IMAGES = 4000, 800


def _idx_part(source: Path, count: int, last: bool) -> bytes:
    """The first (or ``last``) ``count`` items of an idx file, its header's count changed to match."""
    data = gzip.open(source).read()
    dims = data[3]
    total = int.from_bytes(data[4:8], "big")
    item = math.prod(int.from_bytes(data[8 + 4 * i: 12 + 4 * i], "big") for i in range(dims - 1))
    start = 4 + 4 * dims + (total - count) * item * last
    return data[:4] + count.to_bytes(4, "big") + data[8:4 + 4 * dims] + data[start: start + count * item]


@pytest.fixture(scope="module")
def mnist_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("home")
    raw = home / ".torch" / "datasets" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, count, last in (("train", TRAIN_IMAGES, False), ("t10k", TEST_IMAGES, True)):
        for kind in ("images-idx3", "labels-idx1"):
            (raw / f"{split}-{kind}-ubyte").write_bytes(_idx_part(DATA / f"t10k-{kind}-ubyte.gz", count, last))
    return home


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
