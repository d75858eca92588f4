"""Data-parallel MNIST: seed 002's addons MLP trained by R replicas (``Ir(replication=R)``).

Every replica runs the same program on its own micro-batch: the host data of a
stream is shaped ``(device_iterations, R, batch, ...)``. After the backward pass each
gradient is averaged over the replicas with
``ops.collectives.replicated_all_reduce_(g, "mean")``, so every replica applies the
same SGD update and the replicas' weights stay identical. Evaluation is data
parallel too: each replica scores its own slice of every test batch.

The model (``Net``, ``sgd_step``, ``accuracy``) is seed 002's, imported from
``examples/addons_mnist.py``. The same script runs

* in one process, the R replicas taking turns in threads:
  ``python examples/data_parallel_mnist.py --data-dir ../shared/datasets``
* over torchrun processes (each runs R / nproc replicas; the Session joins a gloo
  process group by itself; output is printed by rank 0 only):
  ``torchrun --nproc_per_node 2 examples/data_parallel_mnist.py --data-dir ../shared/datasets``

Collectives reduce in replica order on every process, so both runs give the same
weights, bit for bit, and the same accuracy.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.datasets import mnist_loaders
from ipuxl.device.replicas import world


def _load_seed002():
    """``examples/addons_mnist.py`` as a module (the examples are scripts, not a package)."""
    name = "ipuxl_example_addons_mnist"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "addons_mnist.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_SEED002 = _load_seed002()
Net, sgd_step, accuracy = _SEED002.Net, _SEED002.sgd_step, _SEED002.accuracy


def mean_gradient_sgd(variables: addons.NamedTensors, grads, learning_rate: float) -> None:
    """Seed 002's SGD step on the mean gradient over all replicas (data parallelism)."""
    for t in variables.tensors:
        grads[t] = ops.collectives.replicated_all_reduce_(grads[t], "mean")  # the returned tensor: read after the reduce
    sgd_step(variables, grads, learning_rate)


def train_program(batch_size: int, replicas: int, device: str, learning_rate: float, device_iterations: int):
    """Seed 002's training step, replicated, with the gradients averaged over the replicas."""
    return _SEED002.train_program(batch_size, device, learning_rate, optimiser=mean_gradient_sgd,
                                  num_host_transfers=device_iterations, replicas=replicas)


def test_program(test_batch_size: int, replicas: int, device: str):
    """Inference, replicated: each replica scores ``test_batch_size`` images per step."""
    return _SEED002.test_program(test_batch_size, device, replicas=replicas)


def per_replica(data: torch.Tensor, *leading: int) -> torch.Tensor:
    """A loader batch of ``prod(leading) * b`` samples as ``(*leading, b, ...)``: consecutive
    chunks go to consecutive device iterations, then replicas."""
    n = int(np.prod(leading))
    return data.reshape(*leading, data.shape[0] // n, *data.shape[1:])


def train(session: ipuxl.Session, streams, loader, epochs: int, loss_stream, replicas: int,
          device_iterations: int, show: bool) -> float:
    """Train; returns the mean loss of the last call (all replicas' losses are returned on every rank)."""
    loss = float("nan")
    with session:
        for epoch in range(1, epochs + 1):
            if show:
                print(f"Epoch {epoch}/{epochs}")
            bar = tqdm(loader, total=len(loader), disable=not show)
            for data, labels in bar:
                images = per_replica(data.squeeze(1).float(), device_iterations, replicas)
                targets = per_replica(labels.int(), device_iterations, replicas)
                losses = session.run(dict(zip(streams, [images, targets])))[loss_stream]
                loss = float(np.mean(losses))
                bar.set_description(f"Loss:{loss:0.4f}")
    return loss


def evaluate(train_session: ipuxl.Session, train_variables: addons.NamedTensors, test_batch_size: int,
             replicas: int, device: str, loader, show: bool) -> float:
    """Validate in a second replicated session holding the trained weights (replica 0's: all are equal)."""
    trained = train_session.get_tensors_data(train_variables.tensors)
    test_session, (stream,), test_variables, out_stream = test_program(test_batch_size, replicas, device)
    test_session.write_variables_data({test_var: trained[train_var].copy()
                                       for train_var, test_var in train_variables.to_mapping(test_variables).items()})
    correct = total = 0.0
    with test_session:
        for data, labels in tqdm(loader, total=len(loader), disable=not show):
            output = test_session.run({stream: per_replica(data.squeeze(1).float(), replicas)})[out_stream]
            scores = output.reshape(-1, output.shape[-1])  # (R, b, 10) -> replica-major == loader order
            correct += accuracy(scores, labels) * len(labels) / 100.0
            total += len(labels)
    return 100.0 * correct / total


class Result(NamedTuple):
    accuracy: float
    final_loss: float
    replicas: int
    processes: int
    offline_split: bool


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Data-parallel popxl.addons MNIST (seed 002) on ipuxl replicas")
    parser.add_argument("--replicas", type=int, default=2, help="replication factor R (default 2)")
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch per replica")
    parser.add_argument("--test-batch-size", type=int, default=50, help="test micro-batch per replica")
    parser.add_argument("--device-iterations", type=int, default=10,
                        help="training steps per Session.run (ir.num_host_transfers)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one micro-batch (seed 002's); the step uses lr x R on the mean "
                             "gradient of R micro-batches (linear scaling rule)")
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: $IPUXL_DATA or ./data)")
    parser.add_argument("--device", default="cpu", choices=["ipu_model", "cpu", "ipu_hw"])
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Result:
    opts = parse_args(argv)
    processes, rank = world()
    show = rank == 0  # under torchrun every rank computes everything; rank 0 prints
    np.random.seed(opts.seed)  # the same initial weights on every rank
    torch.manual_seed(opts.seed)
    replicas, n = opts.replicas, opts.device_iterations
    # Every rank reads the same shuffled order and passes all replicas' data; the
    # session keeps the slice of the replicas this process runs.
    train_loader, test_loader, split = mnist_loaders(opts.batch_size * replicas * n, opts.test_batch_size * replicas,
                                                     opts.data_dir, seed=opts.seed, verbose=show)
    lr = opts.lr * replicas  # the global batch is R times larger: scale the step (linear scaling rule)
    session, streams, variables, loss_stream = train_program(opts.batch_size, replicas, opts.device, lr, n)
    if show:
        where = f"{processes} processes x {replicas // processes}" if processes > 1 else f"1 process x {replicas}"
        print(f"Data parallel: {replicas} replicas ({where}), micro-batch {opts.batch_size} per replica, "
              f"global batch {opts.batch_size * replicas}, lr {lr:g}, {n} steps per run, "
              f"{len(train_loader) * n} steps per epoch")
    loss = train(session, streams, train_loader, opts.epochs, loss_stream, replicas, n, show)
    result = evaluate(session, variables, opts.test_batch_size, replicas, opts.device, test_loader, show)
    if show:
        data = "offline split: first 8000 test images for training, last 2000 for evaluation" \
            if split.offline_split else "MNIST train/test"
        print(f"Test accuracy: {result:.2f}% ({replicas} replicas over {processes} process"
              f"{'es' if processes > 1 else ''}; {data}; final loss {loss:.4f})")
    return Result(result, loss, replicas, processes, split.offline_split)


if __name__ == "__main__":
    main()
