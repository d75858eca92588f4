"""Graphcore's "remote variables and RTS" and "phased execution" MNIST tutorials (#17;
copies in ../shared/reference/popxl_5_* and popxl_6_*) run unchanged through
``python -m ipuxl.compat`` on the offline data (see ``test_popxl_data_parallelism``).

Both train 2 replicas x 4 accumulated micro-batches with Adam (program 5 with
``--data-parallel 2 --gradient-accumulation 4``, as program 3's test; program 6's
defaults). Their optimiser state (and program 6's weights) live in Streaming Memory,
sharded over the replicas. Like the non-phased program 3 they must learn (chance is 10%).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.reference.test_popxl_data_parallelism import REFERENCE, _check_trained, _env, _free_port, needs_programs
from tests.reference.test_popxl_data_parallelism import mnist_home  # noqa: F401 - the shared fixture
from tests.conftest import ROOT

POPXL_5 = REFERENCE / "popxl_5_remote_variables_and_rts" / "mnist.py"
POPXL_6 = REFERENCE / "popxl_6_phased_execution" / "mnist.py"


def _run(program, home, *args: str, torchrun: bool = False) -> subprocess.CompletedProcess:
    env = _env(home)
    env["PYTHONPATH"] = str(ROOT)  # this checkout's ipuxl, not another installed copy
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                 str(_free_port())] if torchrun else [sys.executable])
    return subprocess.run([*launcher, "-m", "ipuxl.compat", str(program), *args], env=env, cwd=home,
                          capture_output=True, text=True, timeout=300)


@needs_programs
@pytest.mark.skipif(not POPXL_5.exists(), reason="reference program 5 not available")
@pytest.mark.slow  # about 45 s: one run in one process, one over two torchrun processes
def test_popxl_5_remote_optimiser_state_and_rts_learns_in_process_and_under_torchrun(mnist_home):
    args = ("--data-parallel", "2", "--gradient-accumulation", "4")
    (accuracy,) = _check_trained(_run(POPXL_5, mnist_home, *args))
    assert accuracy >= 60.0
    accuracies = _check_trained(_run(POPXL_5, mnist_home, *args, torchrun=True))
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1] and accuracies[0] >= 60.0


@needs_programs
@pytest.mark.skipif(not POPXL_6.exists(), reason="reference program 6 not available")
@pytest.mark.slow  # about 15 s
def test_popxl_6_phased_execution_learns(mnist_home):
    (accuracy,) = _check_trained(_run(POPXL_6, mnist_home))
    assert accuracy >= 60.0


@needs_programs
@pytest.mark.skipif(not POPXL_6.exists(), reason="reference program 6 not available")
@pytest.mark.slow  # about 30 s
def test_popxl_6_phased_execution_learns_under_torchrun(mnist_home):
    accuracies = _check_trained(_run(POPXL_6, mnist_home, torchrun=True))
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1] and accuracies[0] >= 60.0
