"""Training throughput of the popxl.addons-style MLP (seed 002/004) against eager PyTorch.

Run:   python benchmarks/bench_addons.py [--repeats 7] [--steps 100] [--quick] [--threads T]

The 784-512-512-512-10 GELU MLP is built as seed 002 does (``addons.Module`` layers,
``addons.autodiff``, ``cross_entropy_with_grad``) and updated either with SGD
(``ops.scaled_add_``, lr 0.05) or with the graph optimiser ``ipuxl.optim.AdamUpdate``
(lr 1e-3, torch's defaults) applied to every variable. Eager PyTorch trains the same
function with autograd and ``torch.optim.SGD`` / ``torch.optim.Adam``. Both start
from the same weights and read the same pre-generated data; before timing, a few
steps are checked to give the same weights. Timings alternate between the two and
the median of ``--repeats`` is reported, for batch 8 and 128 with N = 1 and 50
steps per call.
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Callable

import numpy as np
import torch

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl import optim

try:
    from benchmarks.bench_mlp import EagerMLP, alternate_timings, make_data
except ImportError:  # run as a script from benchmarks/
    from bench_mlp import EagerMLP, alternate_timings, make_data

SIZES = [784, 512, 512, 512, 10]
OPTIMISERS = {"sgd": 0.05, "adam": 1e-3}


class Net(addons.Module):
    def __init__(self):
        super().__init__()
        for i, out in enumerate(SIZES[1:], start=1):
            setattr(self, f"fc{i}", addons.Linear(out))

    def build(self, x: ipuxl.Tensor) -> ipuxl.Tensor:
        x = x.reshape((-1, SIZES[0]))
        for i in range(1, len(SIZES) - 1):
            x = ops.gelu(getattr(self, f"fc{i}")(x))
        return getattr(self, f"fc{len(SIZES) - 1}")(x)


def build_program(batch: int, n: int, optimiser: str):
    """The training program in PopXL's device-loop form: the variables (the net's, and
    Adam's state) in the main graph, ``ops.repeat`` of a step graph that loads its batch,
    runs forward and backward and updates every variable (passed by reference) ``n`` times."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = n
    lr = OPTIMISERS[optimiser]
    with ir.main_graph:
        img_stream = ipuxl.h2d_stream((batch, 28, 28), ipuxl.float32, "image")
        label_stream = ipuxl.h2d_stream((batch,), ipuxl.int32, "labels")
        loss_stream = ipuxl.d2h_stream((), ipuxl.float32, "loss")
        facts, fwd = Net().create_graph(img_stream.spec)
        bwd = addons.autodiff(fwd)
        variables = facts.init()
        updates = _optimiser_graphs(optimiser, variables, lr)  # {name: (graph, its state variables)}
        held = [*variables.tensors, *(t for _, state in updates.values() for t in state.tensors)]

        def step(*inputs: ipuxl.Tensor) -> None:
            mine = dict(zip(held, inputs))
            img, labels = ops.host_load(img_stream), ops.host_load(label_stream)
            net = addons.NamedTensors.from_dict({k: mine[v] for k, v in variables.named_tensors.items()})
            fwd_info = fwd.bind(net).call_with_info(img)
            loss, dx = addons.ops.cross_entropy_with_grad(fwd_info.outputs[0], labels)
            bwd_info = bwd.call_with_info(dx, args=bwd.grad_graph_info.inputs_dict(fwd_info))
            grads = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(fwd_info, bwd_info)
            for name, var in variables.named_tensors.items():
                if optimiser == "sgd":
                    ops.scaled_add_(mine[var], grads[mine[var]], b=-lr)
                else:
                    graph, state = updates[name]
                    bound = addons.NamedTensors.from_dict({k: mine[v] for k, v in state.named_tensors.items()})
                    graph.bind(bound).call(mine[var], grads[mine[var]])
            ops.host_store(loss_stream, loss)

        ops.repeat(ir.create_graph(step, *[ipuxl.TensorByRef(t) for t in held]), n, *held)
    return ir, (img_stream, label_stream), loss_stream, variables


def _optimiser_graphs(optimiser: str, variables, lr: float) -> dict:
    """Adam: per variable, the ``AdamUpdate`` graph (one per weight spec) and its state
    variables (created here, in the main graph); SGD needs none."""
    if optimiser == "sgd":
        return {}
    update = optim.AdamUpdate()
    graphs = {}
    for name, var in variables.named_tensors.items():
        factories, graph = update.create_graph(var, ipuxl.TensorSpec(var.shape, var.dtype), lr=lr)
        graphs[name] = (graph, factories.init(prefix=name))
    return graphs


class IpuxlTrainer:
    def __init__(self, batch: int, n: int, optimiser: str):
        self.ir, self.streams, self.loss_stream, self.variables = build_program(batch, n, optimiser)
        self.session = ipuxl.Session(self.ir, "cpu")
        self.session.__enter__()
        self.n = n

    def init(self) -> list[tuple[np.ndarray, np.ndarray]]:
        data = {k: self.session.get_tensor_data(t).copy() for k, t in self.variables.named_tensors.items()}
        return [(data[f"fc{i}.weight"], data[f"fc{i}.bias"]) for i in range(1, len(SIZES))]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        if self.n == 1:
            x, y = x[0], y[0]
        return self.session.run(dict(zip(self.streams, (x, y))))[self.loss_stream]

    def weights(self) -> list[np.ndarray]:
        data = {k: self.session.get_tensor_data(t) for k, t in self.variables.named_tensors.items()}
        return [data[f"fc{i}.{p}"] for i in range(1, len(SIZES)) for p in ("weight", "bias")]


class EagerTrainer:
    def __init__(self, init, optimiser: str):
        self.model = EagerMLP(init, final_gelu=False)
        make: Callable = torch.optim.SGD if optimiser == "sgd" else torch.optim.Adam
        self.opt = make(self.model.parameters(), lr=OPTIMISERS[optimiser])

    def step(self, xs: torch.Tensor, ys: torch.Tensor) -> np.ndarray:
        losses = []
        for x, y in zip(xs, ys):
            self.opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            losses.append(loss.detach())
        return torch.stack(losses).numpy()

    def weights(self) -> list[np.ndarray]:
        return [p.detach().numpy() for p in self.model.parameters()]


def verify(optimiser: str, steps: int = 3, batch: int = 8) -> None:
    np.random.seed(0)
    ipu = IpuxlTrainer(batch, steps, optimiser)
    eager = EagerTrainer(ipu.init(), optimiser)
    (x, y32, y64), = make_data(steps, batch, 1, torch.device("cpu"), seed=123)
    torch.testing.assert_close(torch.from_numpy(ipu.step(x, y32)), torch.from_numpy(eager.step(x, y64)),
                               rtol=1e-4, atol=1e-4)
    for a, b in zip(ipu.weights(), eager.weights()):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-4, atol=1e-4)
    print(f"mlp512+{optimiser}: weights match eager: yes (after {steps} steps, batch {batch})")


def measure(optimiser: str, batch: int, n: int, steps: int, repeats: int) -> tuple[float, float]:
    np.random.seed(0)
    ipu = IpuxlTrainer(batch, n, optimiser)
    eager = EagerTrainer(ipu.init(), optimiser)
    calls = max(1, math.ceil(steps / n))
    data = make_data(n, batch, min(calls, 4), torch.device("cpu"))
    run_ipu = lambda x, y32, y64: ipu.step(x, y32)  # noqa: E731
    run_eager = lambda x, y32, y64: eager.step(x, y64)  # noqa: E731
    return alternate_timings(run_ipu, run_eager, data, calls, repeats, calls * n * batch)


def main(argv: list[str] | None = None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 repeats, 10 steps")
    parser.add_argument("--threads", type=int, default=None)
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.steps = 2, 10
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, repeats {opts.repeats}, "
          f"steps/timing {opts.steps}")
    start = time.perf_counter()
    for optimiser in OPTIMISERS:
        verify(optimiser)
    header = f"{'network':<12} {'batch':>5} {'N':>3} {'ipuxl samples/s':>16} {'eager samples/s':>16} {'ipuxl/eager':>11}"
    print(header + "\n" + "-" * len(header))
    rows = []
    for optimiser in OPTIMISERS:
        for batch in (8, 128):
            for n in (1, 50):
                ipu, eager = measure(optimiser, batch, n, opts.steps, opts.repeats)
                rows.append((optimiser, batch, n, ipu, eager))
                print(f"{'mlp512+' + optimiser:<12} {batch:>5} {n:>3} {ipu:>16,.0f} {eager:>16,.0f} "
                      f"{ipu / eager:>11.2f}", flush=True)
    print(f"total time {time.perf_counter() - start:.1f} s")
    return rows


if __name__ == "__main__":
    main()
