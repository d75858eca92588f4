"""Running a benchmark script as its users do: a fresh Python process (the scripts set
process-wide state: thread counts, import hooks, torch.compile's configuration)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, timeout: int = 240) -> str:
    """``python benchmarks/<name> args`` from the repository root with this checkout's
    ipuxl; its output (stdout and stderr) when it exits 0, else the test fails with it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} {' '.join(args)} exited {done.returncode}:\n{output[-4000:]}"
    return output
