"""What a ``trainingModel``'s first call costs: capture, passes, device compile and the first run.

Run:   python benchmarks/bench_first_call.py [--models resnet50,densenet121] [--threads 1]

Per model (``bench_models.MODELS``, built as ``bench_models.build`` does: micro-batch 4 of
3x64x64 images, SGD with momentum, ``deviceIterations(2)``), in a fresh process each (a
process's first compile also imports what compiling needs): the wall-clock and CPU seconds
of the first call (capture + compile + the first 2 steps), then of the second call (the
steps alone), and the memory format chosen. The machine's 1-minute load average is printed
before each model: on a loaded machine the wall clock grows with the load, the CPU time
much less.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def one(name: str, threads: int | None) -> None:
    """Time ``name``'s first and second call in this process and print one line."""
    import torch

    sys.path.insert(0, HERE)
    import ipuxl
    from bench_models import BATCH, IMAGE, ITERATIONS, _sgd, build

    if threads:
        torch.set_num_threads(threads)
    model = build(name)
    training = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(ITERATIONS), optimizer=_sgd(model))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * ITERATIONS, 3, IMAGE, IMAGE, generator=g)
    y = torch.randint(0, 10, (BATCH * ITERATIONS,), generator=g)
    times = []
    for _ in range(2):
        wall, cpu = time.perf_counter(), time.process_time()
        training(x, y)
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    (first, first_cpu), (second, second_cpu) = times
    print(f"{name:20s} first call {first:6.2f} s (CPU {first_cpu:5.2f} s)   second {second:5.2f} s "
          f"(CPU {second_cpu:5.2f} s)   {'channels-last' if training._channels_last else 'NCHW'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,densenet121", help="comma-separated names of bench_models.MODELS")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: time this model
    opts = parser.parse_args()
    if opts.one:
        one(opts.one, opts.threads)
        return
    for name in opts.models.split(","):
        print(f"load average (1 min) {os.getloadavg()[0]:.2f}", flush=True)
        command = [sys.executable, os.path.abspath(__file__), "--one", name]
        if opts.threads:
            command += ["--threads", str(opts.threads)]
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
