"""Ctrl-C during a run of in-process replicas: the replica threads stop before the call returns.

A program that catches KeyboardInterrupt around its training loop, saves a checkpoint
and returns must exit cleanly; a replica thread left inside torch's kernels at
interpreter exit aborts the process ("terminate called without an active exception").
The subprocess test runs this file as a script (``python test_interrupt.py CHECKPOINT``).
"""
from __future__ import annotations

import _thread
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops

HERE = Path(__file__).resolve()
SIZE, STEPS = 256, 64


def _replica_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ipuxl-replica-")]


def _build_slow_replicated_sum() -> tuple[ipuxl.Ir, ipuxl.DeviceToHostStream]:
    """2 replicas, ``STEPS`` matmuls each followed by an all-reduce: a run that takes a while."""
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        w = ipuxl.variable(np.eye(SIZE, dtype=np.float32) * 0.5, name="w")
        x = ipuxl.variable(np.ones((SIZE, SIZE), dtype=np.float32), name="x")
        for _ in range(STEPS):
            x = ops.collectives.replicated_all_reduce(x @ w, op="mean") * 2.0
        total = ops.sum(x)
        out = ipuxl.d2h_stream(total.shape, ipuxl.float32, "out")
        ops.host_store(out, total)
    return ir, out


def test_an_interrupted_replicated_run_stops_its_replica_threads_and_the_session_runs_again():
    ir, out = _build_slow_replicated_sum()
    with ipuxl.Session(ir, "cpu") as session:
        expected = session.run()[out]  # also compiles, so the timed run below only runs
        assert_close(torch.from_numpy(expected), torch.full((2,), float(SIZE * SIZE)))
        start = time.monotonic()
        session.run()
        one_run = time.monotonic() - start
        timer = threading.Timer(one_run / 4, _thread.interrupt_main)  # Ctrl-C while the replicas run
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                for _ in range(1000):  # in case the timer fires between two runs
                    session.run()
        finally:
            timer.cancel()
        assert _replica_threads() == []  # none left running torch code
        assert_close(session.run()[out], expected)  # the barrier is usable again


def _interrupt_main_when(event: threading.Event) -> threading.Thread:
    """Send a real SIGINT to the main thread once ``event`` is set (a blocked wait wakes)."""
    def send() -> None:
        event.wait()
        time.sleep(0.05)  # the caller is waiting by now
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


@pytest.mark.parametrize("attempt", range(4))
def test_ctrl_c_while_waiting_for_the_replicas_returns_only_after_every_replica_has_finished(attempt):
    """After a collective, replica 0 runs a long op and replica 1 returns; Ctrl-C lands
    while the caller waits. ``run_replicas`` raises only once replica 0's op has returned.
    (Waiting with ``Thread.join`` it did not, whenever replica 1 took the turn first: in
    Python 3.11 an interrupted ``join`` marks the running thread stopped.)"""
    from ipuxl.device.replicas import Communicator, run_replicas

    comm = Communicator(2, [0, 1])
    long_op_started, finished = threading.Event(), []

    def work(i: int):
        def run() -> None:
            comm.exchange(i, torch.ones(2), lambda tensors, replicas: [sum(tensors)] * len(replicas))
            if i == 0:
                long_op_started.set()
                time.sleep(0.4)  # no collective after it: breaking the barrier does not stop it
            finished.append(i)
        return run

    sender = _interrupt_main_when(long_op_started)
    with pytest.raises(KeyboardInterrupt):
        run_replicas(comm, [work(0), work(1)])
    sender.join()
    assert sorted(finished) == [0, 1]
    assert _replica_threads() == []


def _checkpoint_after_ctrl_c(checkpoint: str) -> None:
    """The reported program: PopTorch training with 2 in-process replicas, Ctrl-C caught."""
    import ipuxl.compat

    ipuxl.compat.install()
    import poptorch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(SIZE, SIZE) for _ in range(8)])

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x, y):
            out = self.model(x)
            return out, torch.nn.functional.mse_loss(out, y)

    training = poptorch.trainingModel(WithLoss(), poptorch.Options().replicationFactor(2).deviceIterations(8),
                                      torch.optim.SGD(model.parameters(), lr=1e-3))
    x, y = torch.randn(2 * 8 * 64, SIZE), torch.randn(2 * 8 * 64, SIZE)
    training(x, y)
    print("ready", flush=True)
    try:
        while True:
            training(x, y)
    except KeyboardInterrupt:
        training.copyWeightsToHost()
        torch.save(model.state_dict(), checkpoint)
        print("saved", flush=True)


def test_a_program_catching_ctrl_c_in_replicated_training_saves_and_exits_cleanly(tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    for attempt in range(2):  # two interrupts at different points of a call
        child = subprocess.Popen([sys.executable, str(HERE), str(checkpoint)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(0.2 + 0.5 * attempt)
            child.send_signal(signal.SIGINT)
            out, err = child.communicate(timeout=120)
        finally:
            child.kill()
        assert "terminate called" not in err and child.returncode == 0, err[-2000:]
        assert out.strip() == "saved"
        state = torch.load(checkpoint)
        assert sorted(state) == sorted(f"{i}.{p}" for i in range(8) for p in ("weight", "bias"))
        checkpoint.unlink()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _checkpoint_after_ctrl_c(sys.argv[1])
