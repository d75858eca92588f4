"""Seed 001: PopXL MNIST (two Linear graphs, per-layer autodiff, SGD) written with ipuxl.

Run: ``python examples/popxl_mnist.py --data-dir ../shared/datasets``
"""
from __future__ import annotations

import argparse
from typing import Mapping, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

import ipuxl
import ipuxl.ops as ops
import ipuxl.transforms as transforms
from ipuxl.datasets import mnist_loaders
from ipuxl.ops import CallSiteInfo


class Linear(ipuxl.Module):
    def __init__(self) -> None:
        self.W: ipuxl.Tensor | None = None
        self.b: ipuxl.Tensor | None = None

    def build(self, x: ipuxl.Tensor, out_features: int, bias: bool = True) -> ipuxl.Tensor:
        self.W = ipuxl.graph_input((x.shape[-1], out_features), ipuxl.float32, "W")
        y = x @ self.W
        if bias:
            self.b = ipuxl.graph_input((out_features,), ipuxl.float32, "b")
            y = y + self.b
        return ops.gelu(y)


def create_network_fwd_graph(ir: ipuxl.Ir, x: ipuxl.Tensor):
    x = x.reshape((-1, 28 * 28))
    W0 = ipuxl.variable(np.random.normal(0, 0.02, (x.shape[-1], 32)).astype(np.float32), name="W0")
    b0 = ipuxl.variable(np.random.normal(0, 0.02, (32,)).astype(np.float32), name="b0")
    W1 = ipuxl.variable(np.random.normal(0, 0.02, (32, 10)).astype(np.float32), name="W1")
    b1 = ipuxl.variable(np.random.normal(0, 0.02, (10,)).astype(np.float32), name="b1")

    linear_0 = Linear()
    linear_graph_0 = ir.create_graph(linear_0, x, out_features=32)
    fwd_call_info_0 = ops.call_with_info(linear_graph_0, x, inputs_dict={linear_0.W: W0, linear_0.b: b0})
    x1 = fwd_call_info_0.outputs[0]

    linear_1 = Linear()
    linear_graph_1 = ir.create_graph(linear_1, x1, out_features=10)
    fwd_call_info_1 = ops.call_with_info(linear_graph_1, x1, inputs_dict={linear_1.W: W1, linear_1.b: b1})
    y = fwd_call_info_1.outputs[0]

    params = {"W0": W0, "W1": W1, "b0": b0, "b1": b1}
    return (x1, y), params, [linear_0, linear_1], (fwd_call_info_0, fwd_call_info_1)


def calculate_grads(dy, outputs, params, linears, fwd_call_infos: tuple[CallSiteInfo, ...]):
    # Layer 1: all gradients, mapped back to the parent tensors of the forward call.
    bwd_graph_info_1 = transforms.autodiff(fwd_call_infos[1].called_graph)
    activations_1 = bwd_graph_info_1.inputs_dict(fwd_call_infos[1])
    grads_1_call_info = ops.call_with_info(bwd_graph_info_1.graph, dy, inputs_dict=activations_1)
    grads_1 = bwd_graph_info_1.fwd_parent_ins_to_grad_parent_outs(fwd_call_infos[1], grads_1_call_info)
    grad_x_1, grad_w_1, grad_b_1 = grads_1[outputs[0]], grads_1[params["W1"]], grads_1[params["b1"]]

    # Layer 0: only W and b, returned directly by ops.call.
    bwd_graph_info_0 = transforms.autodiff(fwd_call_infos[0].called_graph,
                                           grads_required=[linears[0].W, linears[0].b])
    activations_0 = bwd_graph_info_0.inputs_dict(fwd_call_infos[0])
    grad_w_0, grad_b_0 = ops.call(bwd_graph_info_0.graph, grad_x_1, inputs_dict=activations_0)
    return {"W0": grad_w_0, "b0": grad_b_0, "W1": grad_w_1, "b1": grad_b_1}


def update_weights_bias(lr: float, grads, params) -> None:
    for k, v in params.items():
        ops.scaled_add_(v, grads[k], b=-lr)


def load_batch(batch_size: int):
    """Host-to-device streams for a batch of images and labels, and the loaded tensors."""
    img_stream = ipuxl.h2d_stream([batch_size, 28, 28], ipuxl.float32, name="input_stream")
    x = ops.host_load(img_stream, "x")
    label_stream = ipuxl.h2d_stream([batch_size], ipuxl.int32, name="label_stream")
    labels = ops.host_load(label_stream, "labels")
    return (img_stream, label_stream), x, labels


def build_train_ir(batch_size: int, lr: float):
    ir = ipuxl.Ir()
    ir.num_host_transfers = 1
    ir.replication_factor = 1
    with ir.main_graph, ipuxl.in_sequence():
        input_streams, x, labels = load_batch(batch_size)
        outputs, params, linears, fwd_call_infos = create_network_fwd_graph(ir, x)
        probs = ops.softmax(outputs[1], axis=-1)
        loss, dy = ops.nll_loss_with_softmax_grad(probs, labels)
        grads = calculate_grads(dy, outputs, params, linears, fwd_call_infos)
        update_weights_bias(lr, grads, params)

        loss_stream = ipuxl.d2h_stream(loss.shape, loss.dtype, name="loss_stream")
        ops.host_store(loss_stream, loss)
    return ir, input_streams, loss_stream, params


def build_test_ir(batch_size: int):
    ir = ipuxl.Ir()
    with ir.main_graph, ipuxl.in_sequence():
        input_streams, x, labels = load_batch(batch_size)
        outputs, params, _, _ = create_network_fwd_graph(ir, x)
        correct = ops.sum(ops.cast(ops.equal(ops.argmax(outputs[1], dim=1), labels), ipuxl.int32))
        out_stream = ipuxl.d2h_stream(correct.shape, correct.dtype, name="correct_stream")
        ops.host_store(out_stream, correct)
    return ir, input_streams, out_stream, params


def train(session: ipuxl.Session, loader, epochs: int, input_streams, loss_stream) -> None:
    for epoch in range(1, epochs + 1):
        print(f"Epoch {epoch}/{epochs}")
        bar = tqdm(loader, total=len(loader))
        for data, labels in bar:
            inputs: Mapping[ipuxl.HostToDeviceStream, np.ndarray] = dict(
                zip(input_streams, [data.squeeze(1).float().numpy(), labels.int().numpy()]))
            loss = session.run(inputs)[loss_stream]
            bar.set_description(f"Average loss: {np.mean(loss):.4f}")


def test(session: ipuxl.Session, loader, input_streams, out_stream) -> float:
    correct = total = 0
    for data, labels in tqdm(loader, total=len(loader)):
        inputs = dict(zip(input_streams, [data.squeeze(1).float().numpy(), labels.int().numpy()]))
        correct += int(session.run(inputs)[out_stream])
        total += len(labels)
    return 100.0 * correct / total


def eager_reference(initial: dict[str, np.ndarray], train_loader, test_loader, epochs: int, lr: float) -> float:
    """The same network, init, data order and SGD in eager PyTorch; returns its test accuracy."""
    import torch.nn.functional as F

    w = {k: torch.tensor(v, requires_grad=True) for k, v in initial.items()}

    def forward(data: torch.Tensor) -> torch.Tensor:
        h = F.gelu(data.reshape(-1, 784) @ w["W0"] + w["b0"], approximate="tanh")
        return F.gelu(h @ w["W1"] + w["b1"], approximate="tanh")

    for _ in range(epochs):
        for data, labels in train_loader:
            loss = F.nll_loss(torch.log_softmax(forward(data), dim=-1), labels)
            loss.backward()
            with torch.no_grad():
                for t in w.values():
                    t -= lr * t.grad
                    t.grad = None
    with torch.no_grad():
        correct = sum(int((forward(d).argmax(1) == y).sum()) for d, y in test_loader)
    return 100.0 * correct / (len(test_loader) * test_loader.batch_size)


class Result(NamedTuple):
    accuracy: float
    eager_accuracy: float | None


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description="PopXL MNIST (seed 001) on ipuxl")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--test-batch-size", type=int, default=80)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: $IPUXL_DATA or ./data)")
    parser.add_argument("--device", default="ipu_model", choices=["ipu_model", "cpu", "ipu_hw"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-eager", action="store_true",
                        help="also train the same network with eager PyTorch and print both accuracies")
    opts = parser.parse_args(argv)
    np.random.seed(opts.seed)
    torch.manual_seed(opts.seed)

    train_loader, test_loader, _ = mnist_loaders(opts.batch_size, opts.test_batch_size, opts.data_dir,
                                                 seed=opts.seed)
    train_ir, input_streams, loss_stream, train_params = build_train_ir(opts.batch_size, opts.lr)
    train_session = ipuxl.Session(train_ir, opts.device)
    initial = {k: v.copy() for k, v in zip(train_params, train_session.get_tensors_data(train_params.values()).values())}
    with train_session:
        train(train_session, train_loader, opts.epochs, input_streams, loss_stream)
    trained = train_session.get_tensors_data(train_params.values())

    test_ir, test_streams, out_stream, test_params = build_test_ir(opts.test_batch_size)
    test_session = ipuxl.Session(test_ir, opts.device)
    test_session.write_variables_data({test_params[k]: trained[v] for k, v in train_params.items()})
    with test_session:
        accuracy = test(test_session, test_loader, test_streams, out_stream)
    print(f"Test accuracy: {accuracy:.2f}%")
    eager = None
    if opts.compare_eager:
        train_loader, test_loader, _ = mnist_loaders(opts.batch_size, opts.test_batch_size, opts.data_dir,
                                                     seed=opts.seed, verbose=False)
        eager = eager_reference(initial, train_loader, test_loader, opts.epochs, opts.lr)
        print(f"Eager PyTorch test accuracy (same seed, init and data order): {eager:.2f}%")
    return Result(accuracy, eager)


if __name__ == "__main__":
    main()
