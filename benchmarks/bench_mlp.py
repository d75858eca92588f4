"""Training throughput of ipuxl (PopXL-style graphs) against eager PyTorch.

Run:   python benchmarks/bench_mlp.py [--repeats 7] [--steps 100] [--quick]
                                      [--device cpu|ipu_hw] [--threads T]

What it measures: samples/s of one SGD training step (forward, backward, update)
for two networks, each at batch 8 and 128, with N = 1 and N = 50 steps per call:

* ``mnist``: seed 001's net, 784-32-10, GELU after *each* Linear (incl. the last);
* ``mlp512``: seed 002's MLP, 784-512-512-512-10, GELU between layers only.

ipuxl builds the net as PopXL does (``build_mlp_train_ir``): one subgraph per
Linear, ``transforms.autodiff`` per layer, chained backward calls, ``ops.scaled_add_``
updates, softmax + ``ops.nll_loss_with_softmax_grad``, in PopXL's device-loop form:
the main graph holds the weights and runs ``ops.repeat`` of the training step N
times; the step loads its batch (``ir.num_host_transfers = N``), so one
``Session.run`` trains N steps. Eager is the same function with
autograd, ``F.cross_entropy`` and ``torch.optim.SGD`` (lr 0.05), N steps per call in a
plain Python loop. Both start from the same weights and consume the same random
data, pre-generated on the device (data loading and host transfer are not timed).
Before timing, each network is checked: after a few steps both give the same
weights (rtol/atol 1e-4). A timing runs ``--steps`` steps (rounded up to whole
calls); after one warm-up timing, ipuxl and eager timings alternate ``--repeats``
times and the median is reported. GELU is the tanh approximation in both.
On a small or shared machine, ``--threads 1`` gives far steadier numbers.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops
import ipuxl.transforms as transforms
from ipuxl.device.session import device_for

NETWORKS = {"mnist": ([784, 32, 10], True), "mlp512": ([784, 512, 512, 512, 10], False)}
LR = 0.05


def init_params(layer_sizes: list[int], seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(W (in, out), b (out,))]`` per layer, N(0, 0.02) as seed 001."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(0, 0.02, (i, o)).astype(np.float32), rng.normal(0, 0.02, (o,)).astype(np.float32))
            for i, o in zip(layer_sizes[:-1], layer_sizes[1:])]


# -- ipuxl --------------------------------------------------------------------------------
class Linear(ipuxl.Module):
    """``x @ W + b``, then GELU if ``gelu``: one subgraph per layer."""

    def build(self, x: ipuxl.Tensor, out_features: int, gelu: bool) -> ipuxl.Tensor:
        self.W = ipuxl.graph_input((x.shape[-1], out_features), ipuxl.float32, "W")
        self.b = ipuxl.graph_input((out_features,), ipuxl.float32, "b")
        y = x @ self.W + self.b
        return ops.gelu(y) if gelu else y


def build_mlp_train_ir(layer_sizes: list[int], batch_size: int, lr: float = LR, num_host_transfers: int = 1,
                       final_gelu: bool = False, init: list[tuple[np.ndarray, np.ndarray]] | None = None):
    """PopXL-style SGD training program for an MLP on (batch_size, 28, 28) images.

    Returns ``(ir, (img_stream, label_stream), loss_stream, params)``; ``params`` maps
    ``"W0", "b0", "W1", ...`` to the variables. ``init`` defaults to ``init_params``.
    """
    init = init or init_params(layer_sizes)
    ir = ipuxl.Ir()
    ir.num_host_transfers = num_host_transfers
    with ir.main_graph:
        img_stream = ipuxl.h2d_stream([batch_size, 28, 28], ipuxl.float32, name="input_stream")
        label_stream = ipuxl.h2d_stream([batch_size], ipuxl.int32, name="label_stream")
        loss_stream = ipuxl.d2h_stream((), ipuxl.float32, name="loss_stream")
        params = {}
        for i, (w, b) in enumerate(init):
            params[f"W{i}"], params[f"b{i}"] = ipuxl.variable(w, name=f"W{i}"), ipuxl.variable(b, name=f"b{i}")

        def step(*weights: ipuxl.Tensor) -> None:  # one training step: the device loop's body
            with ipuxl.in_sequence():
                _train_step(ir, dict(zip(params, weights)), img_stream, label_stream, loss_stream, lr, final_gelu)

        step_graph = ir.create_graph(step, *[ipuxl.TensorByRef(v) for v in params.values()])
        ops.repeat(step_graph, num_host_transfers, *params.values())
    return ir, (img_stream, label_stream), loss_stream, params


def _train_step(ir, params, img_stream, label_stream, loss_stream, lr: float, final_gelu: bool) -> None:
    """Load a batch, forward (a Linear graph per layer), backward (autodiff per layer), SGD."""
    n_layers = len(params) // 2
    x = ops.host_load(img_stream, "x")
    x = x.reshape((-1, x.shape[1] * x.shape[2]))
    labels = ops.host_load(label_stream, "labels")
    layers = []  # (input, W, b, Linear module, call-site info) per layer
    for i in range(n_layers):
        W, B = params[f"W{i}"], params[f"b{i}"]
        linear = Linear()
        graph = ir.create_graph(linear, x, out_features=W.shape[1], gelu=i < n_layers - 1 or final_gelu)
        info = ops.call_with_info(graph, x, inputs_dict={linear.W: W, linear.b: B})
        layers.append((x, W, B, linear, info))
        x = info.outputs[0]

    probs = ops.softmax(x, axis=-1)
    loss, dx = ops.nll_loss_with_softmax_grad(probs, labels)
    grads = {}
    for i in reversed(range(n_layers)):  # chained backward calls, last layer first
        x_in, W, B, linear, info = layers[i]
        required = [linear.W, linear.b] if i == 0 else None  # no grad of the images
        bwd = transforms.autodiff(info.called_graph, grads_required=required)
        bwd_info = ops.call_with_info(bwd.graph, dx, inputs_dict=bwd.inputs_dict(info))
        g = bwd.fwd_parent_ins_to_grad_parent_outs(info, bwd_info)
        grads[f"W{i}"], grads[f"b{i}"] = g[W], g[B]
        dx = g[x_in] if i > 0 else None
    for k, v in params.items():
        ops.scaled_add_(v, grads[k], b=-lr)
    ops.host_store(loss_stream, loss)


class IpuxlTrainer:
    """A session over ``build_mlp_train_ir``; ``step(x, y)`` runs N steps."""

    def __init__(self, layer_sizes, batch_size, n, final_gelu, init, device_type):
        self.ir, self.streams, self.loss_stream, self.params = build_mlp_train_ir(
            layer_sizes, batch_size, LR, n, final_gelu, init)
        self.session = ipuxl.Session(self.ir, device_type)
        self.session.__enter__()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        return self.session.run(dict(zip(self.streams, (x, y))))[self.loss_stream]

    def weights(self) -> list[np.ndarray]:
        data = self.session.get_tensors_data(self.params.values())
        return [data[v] for v in self.params.values()]


# -- eager PyTorch ------------------------------------------------------------------------
class EagerMLP(torch.nn.Module):
    def __init__(self, init, final_gelu: bool):
        super().__init__()
        self.final_gelu = final_gelu
        self.weights = torch.nn.ParameterList()
        for w, b in init:
            self.weights.extend([torch.nn.Parameter(torch.from_numpy(w.copy())),
                                 torch.nn.Parameter(torch.from_numpy(b.copy()))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1)
        n = len(self.weights) // 2
        for i in range(n):
            x = x @ self.weights[2 * i] + self.weights[2 * i + 1]
            if i < n - 1 or self.final_gelu:
                x = F.gelu(x, approximate="tanh")
        return x


class EagerTrainer:
    """Autograd + ``torch.optim.SGD``; ``step(x, y)`` runs ``len(x)`` steps in a Python loop."""

    def __init__(self, init, final_gelu, device):
        self.model = EagerMLP(init, final_gelu).to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def step(self, xs: torch.Tensor, ys: torch.Tensor) -> np.ndarray:
        losses = []
        for x, y in zip(xs, ys):
            self.opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            losses.append(loss.detach())
        return torch.stack(losses).cpu().numpy()

    def weights(self) -> list[np.ndarray]:
        return [p.detach().cpu().numpy() for p in self.model.parameters()]


# -- benchmark ------------------------------------------------------------------------------
def make_data(n: int, batch: int, calls: int, device: torch.device, seed: int = 1):
    """``calls`` pre-generated (images, int32 labels, int64 labels), each (n, batch, ...)."""
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(n, batch, 28, 28, generator=g), torch.randint(0, 10, (n, batch), generator=g))
            for _ in range(calls)]
    return [(x.to(device), y.int().to(device), y.to(device)) for x, y in data]


def verify(name, device_type, device, steps=3, batch=8) -> None:
    """Both implementations train ``steps`` steps from the same init: same weights?"""
    sizes, final_gelu = NETWORKS[name]
    init = init_params(sizes)
    ipu, eager = IpuxlTrainer(sizes, batch, steps, final_gelu, init, device_type), EagerTrainer(init, final_gelu, device)
    (x, y32, y64), = make_data(steps, batch, 1, device, seed=123)
    loss_i, loss_e = ipu.step(x, y32), eager.step(x, y64)
    for a, b in zip(ipu.weights(), eager.weights()):
        torch.testing.assert_close(torch.from_numpy(np.asarray(a)), torch.from_numpy(b), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.from_numpy(loss_i), torch.from_numpy(loss_e), rtol=1e-4, atol=1e-4)
    print(f"{name}: weights match eager: yes (after {steps} steps, batch {batch})")


def time_calls(fn, data, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(*data[i % len(data)])
    return time.perf_counter() - start


def alternate_timings(run_ipu, run_eager, data, calls: int, repeats: int, samples: int) -> tuple[float, float]:
    """Median samples/s of (ipuxl, eager) after a warm-up, alternating which runs first."""
    time_calls(run_ipu, data, calls), time_calls(run_eager, data, calls)  # warm-up
    t_ipu, t_eager = [], []
    for r in range(repeats):
        for fn, out in [(run_ipu, t_ipu), (run_eager, t_eager)][::1 if r % 2 == 0 else -1]:
            out.append(time_calls(fn, data, calls))
    return samples / statistics.median(t_ipu), samples / statistics.median(t_eager)


def measure(name, batch, n, steps, repeats, device_type, device) -> tuple[float, float]:
    """Median samples/s of (ipuxl, eager), timings alternated."""
    sizes, final_gelu = NETWORKS[name]
    init = init_params(sizes)
    ipu, eager = IpuxlTrainer(sizes, batch, n, final_gelu, init, device_type), EagerTrainer(init, final_gelu, device)
    calls = max(1, math.ceil(steps / n))
    data = make_data(n, batch, min(calls, 4), device)
    run_ipu = lambda x, y32, y64: ipu.step(x[0], y32[0]) if n == 1 else ipu.step(x, y32)  # noqa: E731
    run_eager = lambda x, y32, y64: eager.step(x, y64)  # noqa: E731
    return alternate_timings(run_ipu, run_eager, data, calls, repeats, calls * n * batch)


def main(argv: list[str] | None = None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timings per implementation (median)")
    parser.add_argument("--steps", type=int, default=100, help="training steps per timing")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 repeats, 10 steps")
    parser.add_argument("--device", default="cpu", choices=["cpu", "ipu_hw"],
                        help="ipu_hw: ipuxl Session('ipu_hw') and eager on CUDA when available")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.steps = 2, 10
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = device_for(opts.device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"repeats {opts.repeats}, steps/timing {opts.steps}")
    start = time.perf_counter()
    for name in NETWORKS:
        verify(name, opts.device, device)
    rows = []
    header = f"{'network':<8} {'batch':>5} {'N':>3} {'ipuxl samples/s':>16} {'eager samples/s':>16} {'ipuxl/eager':>11}"
    print(header + "\n" + "-" * len(header))
    for name in NETWORKS:
        for batch in (8, 128):
            for n in (1, 50):
                ipu, eager = measure(name, batch, n, opts.steps, opts.repeats, opts.device, device)
                rows.append((name, batch, n, ipu, eager))
                print(f"{name:<8} {batch:>5} {n:>3} {ipu:>16,.0f} {eager:>16,.0f} {ipu / eager:>11.2f}", flush=True)
    print(f"total time {time.perf_counter() - start:.1f} s")
    return rows


if __name__ == "__main__":
    main()
