"""Seed 002: popxl.addons MNIST (4-layer 512-wide GELU MLP) written with ipuxl.

Trains with SGD (``ops.scaled_add_``), then validates in a second session whose
variables get the trained weights through ``NamedTensors.to_mapping``.

Run: ``python examples/addons_mnist.py --data-dir ../shared/datasets [--outlined]``
"""
from __future__ import annotations

import argparse
from functools import partial
from typing import Callable, Mapping, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.datasets import mnist_loaders


class Linear(addons.Module):
    def __init__(self, out_features: int, bias: bool = True):
        super().__init__()
        self.out_features = out_features
        self.bias = bias

    def build(self, x: ipuxl.Tensor) -> ipuxl.Tensor:
        w = self.add_variable_input(
            "weight", partial(np.random.normal, 0, 0.02, (x.shape[-1], self.out_features)), x.dtype)
        y = x @ w
        if self.bias:
            b = self.add_variable_input("bias", partial(np.zeros, y.shape[-1]), x.dtype)
            y = y + b
        return y


class Net(addons.Module):
    """fc1..fc4 called inside build: their ops are inlined into Net's graph."""

    def __init__(self, cache: addons.GraphCache | None = None):
        super().__init__(cache=cache)
        self.fc1 = Linear(512)
        self.fc2 = Linear(512)
        self.fc3 = Linear(512)
        self.fc4 = Linear(10)

    def build(self, x: ipuxl.Tensor) -> ipuxl.Tensor:
        x = x.reshape((-1, 28 * 28))
        x = ops.gelu(self.fc1(x))
        x = ops.gelu(self.fc2(x))
        x = ops.gelu(self.fc3(x))
        return self.fc4(x)


class NetOutlined(addons.Module):
    """fc2 and fc3 are two bindings of one Linear graph: its code exists once."""

    def __init__(self, cache: addons.GraphCache | None = None):
        super().__init__(cache=cache)
        self.fc1 = Linear(512)
        self.fc4 = Linear(10)

    def build(self, x: ipuxl.Tensor) -> ipuxl.Tensor:
        x = x.reshape((-1, 28 * 28))
        x = ops.gelu(self.fc1(x))
        facts, subgraph = Linear(512).create_graph(x)
        fc2 = subgraph.bind(self.add_variable_inputs("fc2", facts))
        fc3 = subgraph.bind(self.add_variable_inputs("fc3", facts))
        (x,) = fc2.call(x)
        x = ops.gelu(x)
        (x,) = fc3.call(x)
        x = ops.gelu(x)
        return self.fc4(x)


def sgd_step(variables: addons.NamedTensors, grads: Mapping[ipuxl.Tensor, ipuxl.Tensor], lr: float) -> None:
    for t in variables.tensors:
        ops.scaled_add_(t, grads[t], b=-lr)


Optimiser = Callable[[addons.NamedTensors, Mapping[ipuxl.Tensor, ipuxl.Tensor], float], None]


def train_program(batch_size: int, device: str, learning_rate: float, net: type[addons.Module] = Net,
                  optimiser: Optimiser = sgd_step, num_host_transfers: int = 1, replicas: int = 1):
    """Seed 002's training program: ``num_host_transfers`` SGD steps per ``Session.run``.

    Each step loads its own batch (PopXL: every executed ``host_load`` takes the next
    slice of its stream); with more than one step per run the steps are unrolled in the
    main graph, calling the one forward and one backward graph from every step.
    """
    ir = ipuxl.Ir(replication=replicas)
    ir.num_host_transfers = num_host_transfers
    with ir.main_graph:
        img_stream = ipuxl.h2d_stream((batch_size, 28, 28), ipuxl.float32, "image")
        img_t = ops.host_load(img_stream)
        label_stream = ipuxl.h2d_stream((batch_size,), ipuxl.int32, "labels")
        labels = ops.host_load(label_stream, "labels")

        facts, fwd_graph = net().create_graph(img_t)
        bwd_graph = addons.autodiff(fwd_graph)
        variables = facts.init()
        loss_stream = None
        for step in range(num_host_transfers):
            if step:
                img_t, labels = ops.host_load(img_stream), ops.host_load(label_stream, "labels")
            fwd_info = fwd_graph.bind(variables).call_with_info(img_t)
            x = fwd_info.outputs[0]

            loss, dx = addons.ops.cross_entropy_with_grad(x, labels)
            loss_stream = loss_stream or ipuxl.d2h_stream(loss.shape, loss.dtype, "loss")
            ops.host_store(loss_stream, loss)

            activations = bwd_graph.grad_graph_info.inputs_dict(fwd_info)
            bwd_info = bwd_graph.call_with_info(dx, args=activations)
            grads_dict = bwd_graph.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(fwd_info, bwd_info)
            optimiser(variables, grads_dict, learning_rate)
    return ipuxl.Session(ir, device), [img_stream, label_stream], variables, loss_stream


def test_program(test_batch_size: int, device: str, net: type[addons.Module] = Net, replicas: int = 1):
    ir = ipuxl.Ir(replication=replicas)
    with ir.main_graph:
        in_stream = ipuxl.h2d_stream((test_batch_size, 28, 28), ipuxl.float32, "image")
        in_t = ops.host_load(in_stream)
        facts, graph = net().create_graph(in_t)
        variables = facts.init()
        (outputs,) = graph.bind(variables).call(in_t)
        out_stream = ipuxl.d2h_stream(outputs.shape, outputs.dtype, "outputs")
        ops.host_store(out_stream, outputs)
    ir.num_host_transfers = 1
    return ipuxl.Session(ir, device), [in_stream], variables, out_stream


def accuracy(predictions: np.ndarray, labels: torch.Tensor) -> float:
    ind = np.argmax(predictions, axis=-1).flatten()
    return float(np.mean(ind == labels.detach().numpy().flatten()) * 100.0)


def train(session: ipuxl.Session, streams, loader, epochs: int, loss_stream) -> None:
    with session:
        for epoch in range(1, epochs + 1):
            print(f"Epoch {epoch}/{epochs}")
            bar = tqdm(loader, total=len(loader))
            for data, labels in bar:
                inputs = dict(zip(streams, [data.squeeze(1).float(), labels.int()]))
                loss = session.run(inputs)[loss_stream]
                bar.set_description(f"Loss:{float(loss):0.4f}")


def evaluate(train_session: ipuxl.Session, train_variables: addons.NamedTensors, test_batch_size: int,
             device: str, loader, net: type[addons.Module] = Net) -> float:
    """Validate in a second session holding a copy of the trained weights."""
    train_vars_to_data = train_session.get_tensors_data(train_variables.tensors)
    test_session, streams, test_variables, out_stream = test_program(test_batch_size, device, net)
    train_vars_to_test_vars = train_variables.to_mapping(test_variables)
    test_session.write_variables_data({test_var: train_vars_to_data[train_var].copy()
                                       for train_var, test_var in train_vars_to_test_vars.items()})
    total = 0.0
    with test_session:
        for data, labels in tqdm(loader, total=len(loader)):
            output = test_session.run(dict(zip(streams, [data.squeeze(1).float()])))[out_stream]
            total += accuracy(output, labels)
    return total / len(loader)


class Result(NamedTuple):
    accuracy: float
    eager_accuracy: float | None


def eager_reference(initial: Mapping[str, np.ndarray], train_loader, test_loader, epochs: int,
                    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> float:
    """The same MLP, init and data order trained with eager PyTorch and torch.optim."""
    import torch.nn.functional as F

    weights = {k: torch.tensor(v, requires_grad=True) for k, v in initial.items()}
    optimizer = make_optimizer(list(weights.values()))

    def forward(data: torch.Tensor) -> torch.Tensor:
        x = data.reshape(-1, 784)
        for i in (1, 2, 3):
            x = F.gelu(x @ weights[f"fc{i}.weight"] + weights[f"fc{i}.bias"], approximate="tanh")
        return x @ weights["fc4.weight"] + weights["fc4.bias"]

    for _ in range(epochs):
        for data, labels in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(forward(data), labels).backward()
            optimizer.step()
    with torch.no_grad():
        scores = [accuracy(forward(d).numpy(), y) for d, y in test_loader]
    return sum(scores) / len(scores)


def parse_args(argv: list[str] | None, lr: float, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--test-batch-size", type=int, default=80)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: $IPUXL_DATA or ./data)")
    parser.add_argument("--device", default="ipu_model", choices=["ipu_model", "cpu", "ipu_hw"])
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--compare-eager", action="store_true",
                        help="also train the same network with eager PyTorch and print both accuracies")
    parser.add_argument("--outlined", action="store_true", help="use NetOutlined (fc2/fc3 share one graph)")
    return parser.parse_args(argv)


def run(opts: argparse.Namespace, optimiser: Optimiser,
        make_eager_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> Result:
    """Train, validate in a second session and optionally compare with eager PyTorch."""
    np.random.seed(opts.seed)
    torch.manual_seed(opts.seed)
    net = NetOutlined if opts.outlined else Net
    train_loader, test_loader, _ = mnist_loaders(opts.batch_size, opts.test_batch_size, opts.data_dir,
                                                 seed=opts.seed)
    session, streams, variables, loss_stream = train_program(opts.batch_size, opts.device, opts.lr, net,
                                                             optimiser)
    initial = {name: session.get_tensor_data(t).copy() for name, t in variables.named_tensors.items()}
    train(session, streams, train_loader, opts.epochs, loss_stream)
    result = evaluate(session, variables, opts.test_batch_size, opts.device, test_loader, net)
    print(f"Test accuracy: {result:.2f}%")
    eager = None
    if opts.compare_eager:
        train_loader, test_loader, _ = mnist_loaders(opts.batch_size, opts.test_batch_size, opts.data_dir,
                                                     seed=opts.seed, verbose=False)
        eager = eager_reference(initial, train_loader, test_loader, opts.epochs, make_eager_optimizer)
        kind = type(make_eager_optimizer([torch.zeros(1, requires_grad=True)]))
        name = f"torch.optim.{kind.__name__}" if kind.__module__.startswith("torch.optim") else kind.__name__
        print(f"Eager PyTorch test accuracy (same seed, init and data order; {name}): {eager:.2f}%")
    return Result(result, eager)


def main(argv: list[str] | None = None) -> Result:
    opts = parse_args(argv, 0.05, "popxl.addons MNIST (seed 002) on ipuxl")
    return run(opts, sgd_step, lambda params: torch.optim.SGD(params, lr=opts.lr))


if __name__ == "__main__":
    main()
