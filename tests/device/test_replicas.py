"""In-process replicas: R data-parallel replicas train exactly as eager PyTorch on the full batch.

Each replica runs the PopXL program (forward, autodiff, gradient all-reduce with
op "mean", SGD) on its micro-batch; eager PyTorch steps once per step on the
concatenation of all replicas' micro-batches with a mean-reduced loss.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl import transforms

F32 = ipuxl.float32
SIZES = [(12, 16), (16,), (16, 4), (4,)]  # w0, b0, w1, b1


def _forward(x, t, w0, b0, w1, b1):
    h = ops.gelu(x @ w0 + b0)
    d = h @ w1 + b1 - t
    return ops.mean(d * d)


def _initial(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * 0.3).astype(np.float32) for s in SIZES]


def build_sgd_program(replicas: int, micro: int, steps: int, lr: float, reduce_op: str = "mean",
                      momentum: float = 0.0):
    """A device loop of ``steps`` steps, each: load x, t; loss and grads; all-reduce grads;
    SGD (with momentum)."""
    ir = ipuxl.Ir(replication=replicas)
    ir.num_host_transfers = steps
    with ir.main_graph:
        x_s = ipuxl.h2d_stream((micro, 12), F32, "x")
        t_s = ipuxl.h2d_stream((micro, 4), F32, "t")
        loss_s = ipuxl.d2h_stream((), F32, "loss")
        weights = [ipuxl.variable(v, F32, name=f"w{i}") for i, v in enumerate(_initial())]
        velocities = [ipuxl.variable(np.zeros(w.shape, np.float32), F32, name=f"v{i}")
                      for i, w in enumerate(weights)] if momentum else []

        def step(*held):
            ws, vs = held[:len(weights)], held[len(weights):]
            x, t = ops.host_load(x_s), ops.host_load(t_s)
            graph = ir.create_graph(_forward, x, t, *ws)
            info = ops.call_with_info(graph, x, t, *ws)
            grad_info = transforms.autodiff(graph, grads_required=graph.inputs[2:])
            seed = ipuxl.constant(np.ones((), np.float32), F32, "dloss")
            grads = ops.call(grad_info.graph, seed, inputs_dict=grad_info.inputs_dict(info))
            ops.host_store(loss_s, info.outputs[0])
            for i, (w, g) in enumerate(zip(ws, grads)):
                g = ops.collectives.replicated_all_reduce_(g, reduce_op)
                if reduce_op == "add":
                    g = g * (1.0 / replicas)
                if momentum:
                    ops.scaled_add_(vs[i], g, momentum, 1.0)  # torch's momentum buffer: v = m v + g
                    g = vs[i]
                ops.scaled_add_(w, g, 1.0, -lr)

        held = [*weights, *velocities]
        ops.repeat(ir.create_graph(step, *[ipuxl.TensorByRef(v) for v in held]), steps, *held)
    return ir, x_s, t_s, loss_s, weights


def _eager(xs: np.ndarray, ts: np.ndarray, lr: float, momentum: float = 0.0):
    """Eager SGD on the full batch per step; xs (steps, R*micro, 12)."""
    params = [torch.tensor(v, requires_grad=True) for v in _initial()]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    losses = []
    for x, t in zip(torch.from_numpy(xs), torch.from_numpy(ts)):
        w0, b0, w1, b1 = params
        out = F.gelu(x @ w0 + b0, approximate="tanh") @ w1 + b1
        loss = ((out - t) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach() for p in params], losses


def _data(steps: int, replicas: int, micro: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((steps, replicas * micro, 12)).astype(np.float32)
    ts = rng.standard_normal((steps, replicas * micro, 4)).astype(np.float32)
    return xs, ts


def _per_replica(a: np.ndarray, replicas: int) -> np.ndarray:
    """(steps, R*micro, ...) -> (steps, R, micro, ...): replica r takes rows [r*micro, (r+1)*micro)."""
    return a.reshape(a.shape[0], replicas, -1, *a.shape[2:])


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("reduce_op", ["mean", "add"])
def test_replicas_train_like_eager_on_the_full_batch(replicas, reduce_op):
    steps, micro, lr = 10, 3, 0.1
    xs, ts = _data(steps, replicas, micro)
    ir, x_s, t_s, loss_s, weights = build_sgd_program(replicas, micro, steps, lr, reduce_op)
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run({x_s: _per_replica(xs, replicas), t_s: _per_replica(ts, replicas)})
        got = [session.get_tensor_data(w).copy() for w in weights]
    expected, eager_losses = _eager(xs, ts, lr)
    for g, e in zip(got, expected):
        assert_close(torch.from_numpy(g), e, rtol=1e-5, atol=1e-6)
    # each replica's loss is the loss of its micro-batch; their mean is the full-batch loss
    assert out[loss_s].shape == (steps, replicas)
    assert_close(torch.from_numpy(out[loss_s].mean(1)), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)


def test_replicas_with_momentum_over_several_runs_keep_their_state():
    replicas, steps, micro, lr = 2, 5, 4, 0.05
    xs, ts = _data(2 * steps, replicas, micro, seed=3)
    ir, x_s, t_s, _, weights = build_sgd_program(replicas, micro, steps, lr, momentum=0.9)
    with ipuxl.Session(ir, "cpu") as session:
        for part in (slice(0, steps), slice(steps, 2 * steps)):
            session.run({x_s: _per_replica(xs[part], replicas), t_s: _per_replica(ts[part], replicas)})
        got = [session.get_tensor_data(w).copy() for w in weights]
    expected, _ = _eager(xs, ts, lr, momentum=0.9)
    for g, e in zip(got, expected):
        assert_close(torch.from_numpy(g), e, rtol=1e-5, atol=1e-6)


def test_every_replica_holds_the_same_weights_after_all_reduced_training():
    replicas, steps, micro = 4, 3, 2
    xs, ts = _data(steps, replicas, micro, seed=5)
    ir, x_s, t_s, _, weights = build_sgd_program(replicas, micro, steps, 0.1)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({x_s: _per_replica(xs, replicas), t_s: _per_replica(ts, replicas)})
        attr = weights[0].node.target
        copies = [v[attr] for v in session._replica_vars]
    for c in copies[1:]:
        assert torch.equal(c, copies[0])


def test_without_all_reduce_replicas_diverge_and_all_replicas_mode_shows_them():
    """No collective: each replica trains on its own data (PopXL keeps one copy per replica)."""
    replicas = 2
    ir = ipuxl.Ir(replication=replicas)
    with ir.main_graph:
        x_s = ipuxl.h2d_stream((3,), F32, "x")
        w = ipuxl.variable(np.zeros(3, np.float32), F32, name="w", retrieval_mode="all_replicas")
        ops.scaled_add_(w, ops.host_load(x_s))
    data = np.array([[1, 2, 3], [10, 20, 30]], np.float32)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({x_s: data})
        np.testing.assert_array_equal(session.get_tensor_data(w), data)


def test_a_replica_released_from_a_collective_completes_it_when_another_then_fails():
    """The last replica to reach a collective can run on, fail and stop the others before a
    released one wakes: that one's collective still completed (it returns its result), and
    it stops at its next collective. (Before: it raised half the time, so a failed run
    reported one step fewer applied.)"""
    from ipuxl.device.replicas import Communicator, run_replicas
    from ipuxl.errors import ReplicaFailureError

    def combine(tensors, local):
        return [torch.stack(tensors).sum(0) for _ in tensors]

    for _ in range(50):
        comm = Communicator(2, [0, 1])
        reached = []

        def healthy():
            reached.append(comm.exchange(0, torch.ones(1), combine))
            try:
                comm.exchange(0, torch.ones(1), combine)  # the failing replica never meets it
            except ReplicaFailureError as stopped:
                reached.append(stopped)
                raise

        def failing():
            comm.exchange(1, torch.ones(1), combine)
            raise ValueError("replica 1 fails after the collective")

        with pytest.raises(ValueError, match="replica 1 fails"):
            run_replicas(comm, [healthy, failing])
        assert len(reached) == 2 and reached[0].item() == 2.0
        assert "replica 0 stopped in a collective" in str(reached[1])
