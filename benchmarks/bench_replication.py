"""Data-parallel replicas: training throughput of the 512-wide MLP at R = 1, 2, 4 and over 2 processes.

Run:   python benchmarks/bench_replication.py [--repeats 5] [--steps 50] [--steps-per-run 10]
                                              [--batches 32,128] [--threads T] [--no-processes] [--quick]

What it measures: samples/s of seed 002's training step (784-512-512-512-10 GELU MLP,
popxl.addons style, ``examples/data_parallel_mnist.train_program``: cross entropy,
backward, ``replicated_all_reduce_(g, "mean")`` of every gradient, SGD) with the same
micro-batch B per replica, for

* ``R=1``, ``R=2``, ``R=4`` in this process (``Ir(replication=R)``; the replicas are
  threads that take turns, so on the same cores the ideal time per step is R times
  that of R=1, i.e. the same cost per sample);
* ``R=2 / 2 gloo processes``: the same program under ``torch.distributed.run
  --nproc_per_node 2`` (one replica per process, ``--threads-per-process`` threads
  each; the script relaunches itself); the ideal is the R=1 time per step, as each
  process has its own core(s);
* ``eager``: the same network, initial weights and data with autograd and
  ``torch.optim.SGD`` (one micro-batch per step), in this process: the reference
  for ipuxl/eager.

``--steps-per-run`` steps are one ``Session.run`` (``ir.num_host_transfers``); data is
pre-generated (host data ``(N, R, B, 28, 28)``), not timed. Each timing runs
``--steps`` steps (whole runs); after one warm-up timing per configuration, the
in-process configurations and eager alternate (rotating order) ``--repeats`` times
and each median is reported. First, R = 2 and 4 are checked against eager SGD on
the global batch of R x B samples (same weights after 3 steps, rtol/atol 1e-4).
The table's ``step/R1`` is the time per step over R=1's (in-process ideal: R; 2
processes on their own cores: 1) and ``cost/sample`` that divided by R (1.00: a
replica costs one R=1 step, nothing more; below 1: processes ran in parallel). On a
small shared machine prefer ``--threads 1`` (the gloo processes use
``--threads-per-process``, default 1); compare ratios, not absolute numbers.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mlp import EagerMLP, time_calls  # noqa: E402

LR = 0.05
IN_PROCESS = (1, 2, 4)
PROCESSES = 2


def _load_example():
    name = "ipuxl_example_data_parallel_mnist"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "data_parallel_mnist.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


train_program = _load_example().train_program


class Replicated:
    """The example's training program at R replicas; ``step`` runs one ``Session.run`` of N steps."""

    def __init__(self, replicas: int, batch: int, n: int):
        np.random.seed(0)  # the same initial weights for every R (and on every rank)
        self.session, self.streams, self.variables, self.loss_stream = train_program(batch, replicas, "cpu", LR, n)
        self.session.__enter__()
        self.replicas, self.n = replicas, n

    def init(self) -> list[tuple[np.ndarray, np.ndarray]]:
        data = {k: self.session.get_tensor_data(t).copy() for k, t in self.variables.named_tensors.items()}
        return [(data[f"fc{i}.weight"], data[f"fc{i}.bias"]) for i in range(1, 5)]

    def weights(self) -> list[np.ndarray]:
        data = {k: self.session.get_tensor_data(t) for k, t in self.variables.named_tensors.items()}
        return [data[f"fc{i}.{p}"] for i in range(1, 5) for p in ("weight", "bias")]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        """``x``: (N, R, B, 28, 28); the leading dims of size 1 are dropped as Session.run expects."""
        shape = tuple(d for d in (self.n, self.replicas) if d > 1)
        return self.session.run(dict(zip(self.streams, (x.reshape(*shape, *x.shape[2:]),
                                                        y.reshape(*shape, *y.shape[2:])))))[self.loss_stream]

    def close(self) -> None:
        self.session.__exit__(None, None, None)


class Eager:
    def __init__(self, init, lr: float = LR):
        self.model = EagerMLP(init, final_gelu=False)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)

    def step(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        for x, y in zip(xs, ys):
            self.opt.zero_grad(set_to_none=True)
            F.cross_entropy(self.model(x), y).backward()
            self.opt.step()

    def weights(self) -> list[np.ndarray]:
        return [p.detach().numpy() for p in self.model.parameters()]


def make_data(n: int, replicas: int, batch: int, calls: int, seed: int = 1):
    """``calls`` pre-generated (images (N, R, B, 28, 28), int32 labels, int64 labels)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(calls):
        x = torch.randn(n, replicas, batch, 28, 28, generator=g)
        y = torch.randint(0, 10, (n, replicas, batch), generator=g)
        out.append((x, y.int(), y))
    return out


def verify(replicas: int, steps: int = 3, batch: int = 8) -> None:
    """R replicas with the mean gradient == eager SGD on the global batch of R x B."""
    ipu = Replicated(replicas, batch, steps)
    eager = Eager(ipu.init())
    (x, y32, y64), = make_data(steps, replicas, batch, 1, seed=123)
    ipu.step(x, y32)
    eager.step(x.reshape(steps, replicas * batch, 28, 28), y64.reshape(steps, replicas * batch))
    for a, b in zip(ipu.weights(), eager.weights()):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-4, atol=1e-4)
    ipu.close()
    print(f"R={replicas}: weights match eager SGD on the global batch: yes (after {steps} steps, micro-batch {batch})")


def measure_in_process(batch: int, n: int, steps: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of each in-process configuration and of eager (rotating order)."""
    calls = max(1, math.ceil(steps / n))
    runners: dict[str, Callable[[], float]] = {}
    for replicas in IN_PROCESS:
        trainer = Replicated(replicas, batch, n)
        data = make_data(n, replicas, batch, min(calls, 2))
        runners[f"R={replicas}"] = (lambda t=trainer, d=data: time_calls(lambda x, y32, y64: t.step(x, y32), d, calls))
        if replicas == 1:
            eager = Eager(trainer.init())
            runners["eager"] = (lambda e=eager, d=data: time_calls(lambda x, y32, y64: e.step(x[:, 0], y64[:, 0]),
                                                                  d, calls))
    for run in runners.values():  # warm-up
        run()
    times: dict[str, list[float]] = {k: [] for k in runners}
    names = list(runners)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(runners[name]())
    return {k: statistics.median(v) / (calls * n) for k, v in times.items()}


# -- the gloo processes --------------------------------------------------------------------
def worker(opts: argparse.Namespace) -> None:
    """One rank of the R=2 / 2-process run: median seconds per step, printed by rank 0 as JSON."""
    from ipuxl.device.replicas import world

    torch.set_num_threads(opts.threads_per_process)
    results = {}
    for batch in opts.batches:
        n = opts.steps_per_run
        calls = max(1, math.ceil(opts.steps / n))
        trainer = Replicated(PROCESSES, batch, n)
        data = make_data(n, PROCESSES, batch, min(calls, 2))
        run = lambda: time_calls(lambda x, y32, y64: trainer.step(x, y32), data, calls)  # noqa: E731
        run()  # warm-up
        results[batch] = statistics.median(run() for _ in range(opts.repeats)) / (calls * n)
        trainer.close()
    if world()[1] == 0:
        print("BENCH_RESULT " + json.dumps(results), flush=True)


def measure_processes(opts: argparse.Namespace) -> dict[int, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(PROCESSES), "--master_port",
           str(port), os.path.abspath(__file__), "--worker", "--repeats", str(opts.repeats), "--steps", str(opts.steps),
           "--steps-per-run", str(opts.steps_per_run), "--batches", ",".join(map(str, opts.batches)),
           "--threads-per-process", str(opts.threads_per_process)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = str(opts.threads_per_process)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {PROCESSES}-process run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(lines[0].split(" ", 1)[1]).items()}


def main(argv: list[str] | None = None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timings per configuration (median)")
    parser.add_argument("--steps", type=int, default=50, help="training steps per timing")
    parser.add_argument("--steps-per-run", type=int, default=10, help="ir.num_host_transfers")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[32, 128],
                        help="micro-batches per replica, comma separated")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads here (default: torch's)")
    parser.add_argument("--threads-per-process", type=int, default=1, help="threads of each gloo process")
    parser.add_argument("--no-processes", action="store_true", help="skip the 2-process run")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 repeats, 10 steps, batch 32")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.steps, opts.steps_per_run, opts.batches = 2, 10, 5, [32]
    if opts.worker:
        worker(opts)
        return []
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()} (gloo processes: "
          f"{opts.threads_per_process} each), cpus {os.cpu_count()}, repeats {opts.repeats}, steps/timing "
          f"{opts.steps}, steps/run {opts.steps_per_run}")
    start = time.perf_counter()
    for replicas in IN_PROCESS[1:]:
        verify(replicas)
    processes = {} if opts.no_processes else measure_processes(opts)
    header = (f"{'configuration':<24} {'B':>4} {'ms/step':>8} {'samples/s':>10} {'vs eager':>8} "
              f"{'step/R1':>8} {'cost/sample':>11}")
    print(header + "\n" + "-" * len(header))
    rows = []
    for batch in opts.batches:
        t = measure_in_process(batch, opts.steps_per_run, opts.steps, opts.repeats)
        configs = [(f"R={r} in-process", r, t[f"R={r}"]) for r in IN_PROCESS]
        if batch in processes:
            configs.append((f"R={PROCESSES} / {PROCESSES} gloo procs", PROCESSES, processes[batch]))
        configs.append(("eager PyTorch (1 batch)", 1, t["eager"]))
        eager_rate = batch / t["eager"]
        for name, replicas, per_step in configs:
            rate = replicas * batch / per_step
            rows.append((name, batch, per_step, rate))
            print(f"{name:<24} {batch:>4} {per_step * 1e3:>8.2f} {rate:>10,.0f} {rate / eager_rate:>8.2f} "
                  f"{per_step / t['R=1']:>8.2f} {per_step / t['R=1'] / replicas:>11.2f}", flush=True)
    print(f"total time {time.perf_counter() - start:.1f} s")
    return rows


if __name__ == "__main__":
    main()
