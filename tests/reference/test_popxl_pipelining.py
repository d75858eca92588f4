"""Graphcore's PopXL pipelining tutorial (``../shared/reference/popxl_4_pipelining/mnist.py``: 4 layers on
2 IPUs in 3 pipeline stages, recomputation, Adam) runs unchanged through ``python -m ipuxl.compat``
on the offline MNIST data, and learns."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reference.test_popxl_data_parallelism import DATA, REFERENCE, _check_trained, _env, make_mnist_home
from tests.conftest import ROOT

POPXL_4 = REFERENCE / "popxl_4_pipelining" / "mnist.py"
# 40 steps of 30 samples (5 x 6 accumulated micro-batches); 5 test batches of 80
TRAIN_IMAGES, TEST_IMAGES = 1200, 400


@pytest.fixture(scope="module")
def small_mnist_home(tmp_path_factory) -> Path:
    return make_mnist_home(tmp_path_factory.mktemp("home"), TRAIN_IMAGES, TEST_IMAGES)


@pytest.mark.skipif(not (DATA / "t10k-images-idx3-ubyte.gz").exists() or not POPXL_4.exists(),
                    reason="MNIST test set or the reference program not available")
def test_popxl_4_pipelining_runs_unchanged_and_learns(small_mnist_home):
    env = _env(small_mnist_home)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])  # this tree's ipuxl
    proc = subprocess.run([sys.executable, "-m", "ipuxl.compat", str(POPXL_4)], env=env,
                          cwd=small_mnist_home, capture_output=True, text=True, timeout=300)
    (accuracy,) = _check_trained(proc)
    assert accuracy >= 50.0  # chance is 10%; one epoch of 40 pipelined steps reaches ~70%
