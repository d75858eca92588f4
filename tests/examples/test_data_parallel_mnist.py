"""examples/data_parallel_mnist.py: >= 90% with 2 replicas, the same result in one process and under torchrun."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, load_example

DATA = Path(os.environ.get("IPUXL_DATA", ROOT.parent / "shared" / "datasets"))
needs_data = pytest.mark.skipif(not (DATA / "MNIST" / "raw").exists(), reason="MNIST not available")
RESULT = re.compile(r"^Test accuracy: (\d+\.\d+)% \((\d+) replicas over (\d+) process(?:es)?; (.*); "
                    r"final loss (\S+)\)$", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_data
@pytest.mark.slow
def test_data_parallel_example_in_process_and_under_torchrun(capsys):
    result = load_example("data_parallel_mnist").main(["--data-dir", str(DATA)])
    in_process = capsys.readouterr().out
    assert result.accuracy >= 90.0 and result.replicas == 2 and result.processes == 1
    (line,) = RESULT.findall(in_process)
    assert line[1:3] == ("2", "1")
    if result.offline_split:
        assert "offline split" in line[3]

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", IPUXL_REPLICA_TIMEOUT="60")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
         str(ROOT / "examples" / "data_parallel_mnist.py"), "--data-dir", str(DATA)],
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (torchrun_line,) = RESULT.findall(proc.stdout)  # printed once: by rank 0
    assert torchrun_line[1:3] == ("2", "2")
    # the same accuracy and final loss: the collectives are bit-for-bit those of one process
    assert (torchrun_line[0], torchrun_line[4]) == (line[0], line[4])
    assert proc.stdout.count("Epoch 1/") == 1
