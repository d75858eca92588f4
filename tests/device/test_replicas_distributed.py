"""Replicas over torch.distributed processes (gloo): same bits as in one process, clear failures.

The processes run this file as a script (``python test_replicas_distributed.py MODE OUT_DIR``,
see the bottom), started either by ``torch.distributed.run`` or, where a rank is
meant to die, directly with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set: torchrun's
agent tears the whole group down when one worker dies, which would hide the
survivor's own error. Every process is bounded by a timeout.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()
BATCH, FEATURES, HIDDEN, CLASSES = 4, 64, 32, 10
STEPS_PER_RUN, RUNS = 5, 2  # 10 SGD steps, ir.num_host_transfers = 5
LR = 0.1
TRAIN_REPLICAS = (2, 4)  # each trained over 2 processes and in one process
LAUNCH_TIMEOUT = 120


# -- the program the processes run ---------------------------------------------------------
def build_mlp(replicas: int, steps: int = STEPS_PER_RUN):
    """A 64-32-32-10 GELU MLP (popxl.addons style) whose SGD step uses the replicas' mean
    gradient; ``steps`` steps per run, unrolled in the main graph (each loads its batch)."""
    import ipuxl
    import ipuxl.addons_compat as addons
    import ipuxl.ops as ops

    class MLP(addons.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = addons.Linear(HIDDEN), addons.Linear(HIDDEN), addons.Linear(CLASSES)

        def build(self, x):
            return self.fc3(ops.gelu(self.fc2(ops.gelu(self.fc1(x)))))

    np.random.seed(0)  # the initial weights: the same in every process
    ir = ipuxl.Ir(replication=replicas)
    ir.num_host_transfers = steps
    with ir.main_graph, ipuxl.in_sequence():
        x_stream = ipuxl.h2d_stream((BATCH, FEATURES), ipuxl.float32, "x")
        y_stream = ipuxl.h2d_stream((BATCH,), ipuxl.int32, "y")
        loss_stream = ipuxl.d2h_stream((), ipuxl.float32, "loss")
        facts, fwd = MLP().create_graph(ipuxl.TensorSpec((BATCH, FEATURES), ipuxl.float32))
        bwd = addons.autodiff(fwd)
        variables = facts.init()
        for _ in range(steps):
            x, y = ops.host_load(x_stream), ops.host_load(y_stream)
            fwd_info = fwd.bind(variables).call_with_info(x)
            loss, dlogits = addons.ops.cross_entropy_with_grad(fwd_info.outputs[0], y)
            bwd_info = bwd.call_with_info(dlogits, args=bwd.grad_graph_info.inputs_dict(fwd_info))
            grads = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(fwd_info, bwd_info)
            for t in variables.tensors:
                grads[t] = ops.collectives.replicated_all_reduce_(grads[t], "mean")
                ops.scaled_add_(t, grads[t], b=-LR)
            ops.host_store(loss_stream, loss)
    return ir, (x_stream, y_stream), variables, loss_stream


def mlp_data(replicas: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per run: images ``(STEPS_PER_RUN, R, BATCH, FEATURES)`` and labels ``(STEPS_PER_RUN, R, BATCH)``."""
    rng = np.random.default_rng(replicas)
    return [(rng.standard_normal((STEPS_PER_RUN, replicas, BATCH, FEATURES)).astype(np.float32),
             rng.integers(0, CLASSES, (STEPS_PER_RUN, replicas, BATCH)).astype(np.int32)) for _ in range(RUNS)]


def train_mlp(replicas: int, local_data_only: bool = False) -> dict[str, np.ndarray]:
    """Train 10 steps; the final weights (replica 0's) and every run's losses of all replicas.

    With ``local_data_only`` a process passes only its own replicas' data (under
    torchrun), else every replica's data.
    """
    import ipuxl
    from ipuxl.device.replicas import world

    ir, streams, variables, loss_stream = build_mlp(replicas)
    session = ipuxl.Session(ir, "cpu")
    processes, rank = world()
    local = slice(rank * replicas // processes, (rank + 1) * replicas // processes)
    result: dict[str, np.ndarray] = {}
    with session:
        for i, (x, y) in enumerate(mlp_data(replicas)):
            if local_data_only:
                x, y = x[:, local], y[:, local]
            result[f"loss{i}"] = session.run(dict(zip(streams, (x, y))))[loss_stream]
    result.update({name: session.get_tensor_data(t).copy() for name, t in variables.named_tensors.items()})
    return result


def _worker_train(out: Path) -> None:
    from ipuxl.device.replicas import world

    _worker_bad_world(out)  # first, R=3 over these 2 processes must be refused
    _worker_single_replica_and_rank_only_reads(out)
    _worker_popdist(out)
    for replicas in TRAIN_REPLICAS:
        result = train_mlp(replicas, local_data_only=replicas == 4)
        np.savez(out / f"r{replicas}_rank{world()[1]}.npz", **result)


def _worker_lost_rank(out: Path, how: str) -> None:
    """One good run, then rank 1 dies (``kill``) or stops answering (``hang``) before the next
    collective; rank 0 records what it got."""
    import ipuxl
    from ipuxl.device.replicas import world
    from ipuxl.errors import IpuxlError, ReplicaFailureError

    replicas = 2
    ir, streams, _, loss_stream = build_mlp(replicas)
    session = ipuxl.Session(ir, "cpu")
    rank = world()[1]
    (x, y), _ = mlp_data(replicas)
    inputs = dict(zip(streams, (x, y)))
    start = time.monotonic()
    report = out / f"rank{rank}.txt"
    first_ok = False
    try:
        with session:
            session.run(inputs)
            first_ok = True
            if rank == 1:
                if how == "kill":
                    os._exit(1)
                time.sleep(LAUNCH_TIMEOUT)  # hang: never reach the collective
            start = time.monotonic()
            session.run(inputs)
        report.write_text("NO ERROR\n")
    except ReplicaFailureError as exc:
        elapsed = time.monotonic() - start
        report.write_text(f"REPLICA_FAILURE after {elapsed:.1f} s (first run ok: {first_ok})\n{exc}\n")
    except IpuxlError as exc:
        report.write_text(f"OTHER {type(exc).__name__}\n{exc}\n")
    sys.stdout.flush()
    os._exit(0)  # do not wait in the process group's teardown for the lost peer


def _worker_popdist(out: Path) -> None:
    """``Ir(replication="popdist")``: one replica per process of torchrun's world; a sum
    over the replicas sees every process's data."""
    import ipuxl
    import ipuxl.ops as ops
    from ipuxl.device.replicas import world

    rank = world()[1]
    ir = ipuxl.Ir(replication="popdist")
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((3,), ipuxl.float32, "x")
        y_stream = ipuxl.d2h_stream((3,), ipuxl.float32, "y")
        ops.host_store(y_stream, ops.collectives.replicated_all_reduce(ops.host_load(x_stream), "add"))
    with ipuxl.Session(ir, "cpu") as session:
        summed = session.run({x_stream: np.full(3, rank + 1, np.float32)})[y_stream]  # this process's replica
    np.savez(out / f"popdist_rank{rank}.npz", replicas=ir.replication_factor, summed=summed)


def _worker_single_replica_and_rank_only_reads(out: Path) -> None:
    """An Ir with one replica runs on its own in each process (e.g. an evaluation); a rank
    may read replicated weights alone, without the other rank (no collective, no wait)."""
    import ipuxl
    import ipuxl.ops as ops
    from ipuxl.device.replicas import world

    rank = world()[1]
    ir = ipuxl.Ir()
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2,), ipuxl.float32, "x")
        y_stream = ipuxl.d2h_stream((2,), ipuxl.float32, "y")
        ops.host_store(y_stream, ops.host_load(x_stream) * 2.0)
    with ipuxl.Session(ir, "cpu") as session:
        single = session.run({x_stream: np.full(2, rank + 1, np.float32)})[y_stream]
    ir, streams, variables, loss_stream = build_mlp(2)
    (x, y), _ = mlp_data(2)
    with ipuxl.Session(ir, "cpu") as session:
        session.run(dict(zip(streams, (x, y))))
        if rank == 1:  # rank 0 goes straight on to the next run's collectives
            read_alone = session.get_tensor_data(variables.named_tensors["fc1.weight"]).copy()
        losses = session.run(dict(zip(streams, (x, y))))[loss_stream]
        weights = session.get_tensor_data(variables.named_tensors["fc1.weight"]).copy()
    np.savez(out / f"single_rank{rank}.npz", single=single, losses=losses, weights=weights,
             **({"read_alone": read_alone} if rank == 1 else {}))


def _worker_bad_world(out: Path) -> None:
    import ipuxl
    from ipuxl.device.replicas import world
    from ipuxl.errors import ReplicationError

    ir, *_ = build_mlp(3)
    try:
        ipuxl.Session(ir, "cpu")
        text = "NO ERROR\n"
    except ReplicationError as exc:
        text = f"REPLICATION_ERROR\n{exc}\n"
    (out / f"bad_world_rank{world()[1]}.txt").write_text(text)


# -- launching ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "IPUXL_REPLICA_TIMEOUT": "60", **extra})
    return env


def torchrun(mode: str, out: Path, nproc: int = 2, **env: str) -> subprocess.CompletedProcess:
    # --standalone: torchrun picks a free port itself (no race with a port chosen here)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE), mode, str(out)]
    return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


def launch_direct(mode: str, out: Path, nproc: int = 2, timeout: float = 60, wait_for: tuple[int, ...] | None = None,
                  **env: str) -> list[int | None]:
    """Start the ranks without torchrun's agent; wait up to ``timeout`` s for the ranks ``wait_for``
    (default: all), kill what still runs; return the exit codes (None: killed)."""
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE), mode, str(out)], stdout=log, stderr=subprocess.STDOUT,
            env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                     WORLD_SIZE=str(nproc), **env)))
        log.close()
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for rank, p in enumerate(procs):
        if wait_for is None or rank in wait_for:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for p in procs:  # a rank told to hang (or one past the timeout) is still running
        if p.poll() is None:
            p.kill()
            p.wait()
            codes.append(None)
        else:
            codes.append(p.returncode)
    return codes


def _logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("rank*.log")))


# -- tests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torchrun_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("distributed_train")
    proc = torchrun("train", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def initial_weights(replicas: int) -> dict[str, np.ndarray]:
    import ipuxl

    ir, _, variables, _ = build_mlp(replicas)
    session = ipuxl.Session(ir, "cpu")
    return {name: session.get_tensor_data(t).copy() for name, t in variables.named_tensors.items()}


@pytest.mark.parametrize("replicas", TRAIN_REPLICAS, ids=lambda r: f"R{r}-over-2-processes")
def test_two_processes_give_the_in_process_weights_bit_for_bit(torchrun_out, replicas):
    expected = train_mlp(replicas)  # this process runs all replicas, in threads
    assert expected["loss0"].shape == (STEPS_PER_RUN, replicas)
    assert not np.array_equal(expected["fc1.weight"], initial_weights(replicas)["fc1.weight"])
    for rank in (0, 1):
        with np.load(torchrun_out / f"r{replicas}_rank{rank}.npz") as got:
            assert sorted(got.files) == sorted(expected)
            for name, value in expected.items():
                np.testing.assert_array_equal(got[name], value, err_msg=f"{name}, rank {rank}, R={replicas}")


def test_ir_popdist_has_one_replica_per_torchrun_process(torchrun_out):
    for rank in (0, 1):
        with np.load(torchrun_out / f"popdist_rank{rank}.npz") as got:
            assert int(got["replicas"]) == 2
            # every replica's output comes back to every process: both hold rank 0's 1 + rank 1's 2
            np.testing.assert_array_equal(got["summed"], np.full((2, 3), 1.0 + 2.0, np.float32))


def test_replicas_apply_the_mean_gradient():
    """One step at R=2 equals eager SGD on the mean of the two micro-batches' gradients."""
    import torch
    import torch.nn.functional as F

    import ipuxl

    (x, y), _ = mlp_data(2)
    w = {k: torch.tensor(v, requires_grad=True) for k, v in initial_weights(2).items()}

    def loss(r: int) -> torch.Tensor:
        h = torch.from_numpy(x[0, r])
        for i in (1, 2):
            h = F.gelu(h @ w[f"fc{i}.weight"] + w[f"fc{i}.bias"], approximate="tanh")
        return F.cross_entropy(h @ w["fc3.weight"] + w["fc3.bias"], torch.from_numpy(y[0, r]).long())

    per_replica = [torch.autograd.grad(loss(r), list(w.values())) for r in range(2)]
    ir, streams, variables, _ = build_mlp(2, steps=1)
    session = ipuxl.Session(ir, "cpu")
    with session:
        session.run(dict(zip(streams, (x[0], y[0]))))
    for (name, value), g0, g1 in zip(w.items(), *per_replica):
        torch.testing.assert_close(torch.from_numpy(session.get_tensor_data(variables.named_tensors[name])),
                                   value.detach() - LR * (g0 + g1) / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_lost_rank_fails_the_survivor_with_replica_failure_error(tmp_path, how):
    timeout = "20" if how == "kill" else "5"
    started = time.monotonic()
    codes = launch_direct("lost-" + how, tmp_path, timeout=90, wait_for=(0,), IPUXL_REPLICA_TIMEOUT=timeout)
    elapsed = time.monotonic() - started
    assert codes[0] == 0, f"rank 0 exited with {codes[0]}\n{_logs(tmp_path)}"
    assert codes[1] == (1 if how == "kill" else None)  # None: still hanging, killed by the test
    report = (tmp_path / "rank0.txt").read_text()
    assert report.startswith("REPLICA_FAILURE"), report + _logs(tmp_path)
    assert "(first run ok: True)" in report, report  # it failed in the second run, the one the peer missed
    for fragment in ("a collective across processes failed", "process 0 of 2", "replicas 0..0 of 2",
                     "another process probably died or stopped"):
        assert fragment in report, report
    seconds = float(report.split()[2])
    bound = 20 + 10 if how == "kill" else 5 + 10  # the survivor waits at most about IPUXL_REPLICA_TIMEOUT
    assert seconds < bound, report
    assert elapsed < 80, f"{elapsed:.0f} s"
    if how == "hang":
        assert seconds >= 4, report  # it did wait for the silent rank, for the configured time


def test_single_replica_programs_run_per_process_and_ranks_read_weights_alone(torchrun_out):
    results = [np.load(torchrun_out / f"single_rank{rank}.npz") for rank in (0, 1)]
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got["single"], np.full(2, 2.0 * (rank + 1), np.float32))
    np.testing.assert_array_equal(results[0]["losses"], results[1]["losses"])
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])
    assert not np.array_equal(results[1]["read_alone"], results[1]["weights"])  # read after run 1, before run 2


def test_world_size_not_dividing_replicas_is_a_replication_error(torchrun_out):
    """Under torchrun with 2 processes, a program of 3 replicas is refused by every rank."""
    for rank in (0, 1):
        report = (torchrun_out / f"bad_world_rank{rank}.txt").read_text()
        assert report.startswith("REPLICATION_ERROR"), report
        assert "torchrun started 2 processes but the program has 3 replicas" in report, report
        assert f"process {rank} of 2" in report and "--nproc_per_node among [1, 3]" in report, report


def test_world_size_not_dividing_replicas_fails_before_joining_a_group(monkeypatch):
    import torch.distributed as dist

    import ipuxl
    from ipuxl.errors import ReplicationError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    ir, *_ = build_mlp(3)
    with pytest.raises(ReplicationError, match=r"torchrun started 2 processes but the program has 3 replicas"):
        ipuxl.Session(ir, "cpu")
    assert not dist.is_initialized()


if __name__ == "__main__":
    _mode, _out = sys.argv[1], Path(sys.argv[2])
    if _mode == "train":
        _worker_train(_out)
    elif _mode.startswith("lost-"):
        _worker_lost_rank(_out, _mode.split("-", 1)[1])
    else:
        raise SystemExit(f"unknown mode {_mode}")
