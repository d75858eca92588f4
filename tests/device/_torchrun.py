"""Run a test file as a torchrun program of ``replicas`` processes (the distributed tests here
run themselves: ``python -m torch.distributed.run ... test_x.py OUT_DIR``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LAUNCH_TIMEOUT = 120


def run_over_processes(script: Path, out: Path, replicas: int) -> None:
    """Launch ``script`` with ``out`` as its argument on ``replicas`` processes; fail the test
    with their output when the launch fails. This tree's ipuxl is imported (``PYTHONPATH``)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "IPUXL_REPLICA_TIMEOUT": "60",
                "PYTHONPATH": os.pathsep.join([str(script.parents[2]), env.get("PYTHONPATH", "")])})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(replicas),
           str(script), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
