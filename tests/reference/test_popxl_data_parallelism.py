"""Graphcore's reference programs (../shared/reference) run unchanged through ``python -m ipuxl.compat``.

They read MNIST with torchvision from ``~/.torch/datasets``: each test gives them a
HOME whose ``.torch/datasets/MNIST/raw`` holds images of the real test set (offline,
the training images are not available): its first images under the train names, its
last ones under the test names (no image in both), cut short so a run takes seconds. Dataset files only ever live in pytest's tmp dir.
"""
from __future__ import annotations

import gzip
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

DATA = Path(os.environ.get("IPUXL_DATA", ROOT.parent / "shared" / "datasets")) / "MNIST" / "raw"
REFERENCE = ROOT.parent / "shared" / "reference"
POPXL_3 = REFERENCE / "popxl_3_data_parallelism" / "mnist.py"
needs_programs = pytest.mark.skipif(
    not (DATA / "t10k-images-idx3-ubyte.gz").exists() or not POPXL_3.exists(),
    reason="MNIST test set or the reference programs not available")
ACCURACY = re.compile(r"Accuracy on test set: (\d+\.\d+)%")
LOSS = re.compile(r"Loss:(\d+\.\d+)")
# 64 steps of 64 samples (8 x 4 accumulated x 2 replicas); 5 test batches of 80, covering the test images
TRAIN_IMAGES, TEST_IMAGES = 4096, 400


def _idx_part(source: Path, count: int, last: bool) -> bytes:
    """The first (or ``last``) ``count`` items of an idx file, with the header's count changed to match."""
    data = gzip.open(source).read()
    dims = data[3]
    total = int.from_bytes(data[4:8], "big")
    item = math.prod(int.from_bytes(data[8 + 4 * i: 12 + 4 * i], "big") for i in range(dims - 1))
    start = 4 + 4 * dims + (total - count) * item * last
    return data[:4] + count.to_bytes(4, "big") + data[8:4 + 4 * dims] + data[start: start + count * item]


def make_mnist_home(home: Path, train_images: int, test_images: int) -> Path:
    """Make ``home`` a HOME whose ~/.torch/datasets/MNIST/raw holds test-set images under all four
    names: the first ``train_images`` for training, the last ``test_images`` for testing."""
    raw = home / ".torch" / "datasets" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, count, last in (("train", train_images, False), ("t10k", test_images, True)):
        for kind in ("images-idx3", "labels-idx1"):
            (raw / f"{split}-{kind}-ubyte").write_bytes(_idx_part(DATA / f"t10k-{kind}-ubyte.gz", count, last))
    return home


@pytest.fixture(scope="module")
def mnist_home(tmp_path_factory) -> Path:
    return make_mnist_home(tmp_path_factory.mktemp("home"), TRAIN_IMAGES, TEST_IMAGES)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(HOME=str(home), OMP_NUM_THREADS="1", IPUXL_REPLICA_TIMEOUT="60")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_trained(proc: subprocess.CompletedProcess) -> list[float]:
    """The accuracies the run printed, after checking it ran to the end with finite losses."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = [float(v) for v in LOSS.findall(proc.stderr)]
    assert losses and all(math.isfinite(v) for v in losses)
    accuracies = [float(v) for v in ACCURACY.findall(proc.stdout)]
    assert accuracies and "Throughput" in proc.stdout
    return accuracies


@needs_programs
@pytest.mark.slow  # about 25 s: one run in one process, one over two torchrun processes
def test_popxl_3_data_parallelism_in_process_and_under_torchrun(mnist_home):
    """2 replicas x 4 accumulated micro-batches, Adam: it learns (chance is 10%) both ways.

    The program shuffles with torch's unseeded generator, so runs differ; under torchrun
    every process must end with the same weights (the replicas' mean gradient), which
    the order-independent accuracy over the whole test set shows.
    """
    proc = subprocess.run([sys.executable, "-m", "ipuxl.compat", str(POPXL_3), "--epochs", "1"],
                          env=_env(mnist_home), cwd=mnist_home, capture_output=True, text=True, timeout=300)
    (accuracy,) = _check_trained(proc)
    assert accuracy >= 60.0

    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
         "-m", "ipuxl.compat", str(POPXL_3), "--epochs", "1"],
        env=_env(mnist_home), cwd=mnist_home, capture_output=True, text=True, timeout=300)
    accuracies = _check_trained(torchrun)
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1] and accuracies[0] >= 60.0
