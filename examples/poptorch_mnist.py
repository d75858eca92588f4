"""Seed 003: PopTorch MNIST (a small CNN trained with SGD) written with ipuxl.

The program is the seed's: the same Block/Network/TrainingModelWithLoss classes,
hyperparameters (lr 0.03, micro-batch 8, 50 device iterations, test batch 80),
``AnchorMode.All`` so every micro-batch's predictions come back for the accuracy
bar, ``trainingModel`` with ``torch.optim.SGD`` and evaluation with
``inferenceModel(model)``, which picks up the trained weights. Only the import
names change (``ipuxl`` for ``poptorch``) and the data comes from the local MNIST
files (``--data-dir``), without torchvision.

``--compare-eager`` trains the same network from the same weights on the same batches
with an eager PyTorch loop; its dropout replays the device's masks, so the accuracies
agree up to float rounding (``--eager-torch-dropout``: torch's own masks, a different
random run).

Run: ``python examples/poptorch_mnist.py --data-dir ../shared/datasets [--epochs 3] [--compare-eager]``
"""
from __future__ import annotations

import argparse
import contextlib
import copy
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.optim as optim
from tqdm.auto import tqdm

import ipuxl
from ipuxl.datasets import load_mnist
from ipuxl.poptorch_compat import DropoutReplay


class Block(nn.Module):
    def __init__(self, in_channels, num_filters, kernel_size, pool_size):
        super(Block, self).__init__()
        self.conv = nn.Conv2d(in_channels,
                              num_filters,
                              kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.conv(x)
        x = self.pool(x)
        x = self.relu(x)
        return x


class Network(nn.Module):
    def __init__(self):
        super(Network, self).__init__()
        self.layer1 = Block(1, 32, 3, 2)
        self.layer2 = Block(32, 64, 3, 2)
        self.layer3 = nn.Linear(1600, 128)
        self.layer3_act = nn.ReLU()
        self.layer3_dropout = torch.nn.Dropout(0.5)
        self.layer4 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.layer1(x)
        x = self.layer2(x)
        # Flatten layer
        x = x.view(-1, 1600)
        x = self.layer3_act(self.layer3(x))
        x = self.layer4(self.layer3_dropout(x))
        return x


class TrainingModelWithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, args, loss_inputs=None):
        output = self.model(args)
        loss = self.loss(output, loss_inputs)
        return output, loss


def accuracy(predictions, labels):
    _, ind = torch.max(predictions, 1)
    labels = labels[-predictions.size()[0]:]
    accuracy = \
        torch.sum(torch.eq(ind, labels)).item() / labels.size()[0] * 100.0
    return accuracy


class Result(NamedTuple):
    accuracy: float
    eager_accuracy: float | None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Seed 003: PopTorch-style MNIST CNN on ipuxl")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--test-batch-size", type=int, default=80)
    parser.add_argument("--device-iterations", type=int, default=50)
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: $IPUXL_DATA or ./data)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--ipu-model", action="store_true", help="run on the 'ipu_model' device (default: ipu_hw, "
                                                                 "i.e. CUDA when present, else the CPU)")
    parser.add_argument("--compare-eager", action="store_true",
                        help="also train the same network with eager PyTorch and print both accuracies")
    parser.add_argument("--eager-torch-dropout", action="store_true",
                        help="with --compare-eager: eager dropout draws torch's own masks instead of the device's")
    return parser.parse_args(argv)


def evaluate(model: nn.Module, test_dataset, test_batch_size: int) -> float:
    inference_model = ipuxl.inferenceModel(model)
    test_data = torch.utils.data.DataLoader(test_dataset, batch_size=test_batch_size, shuffle=True, drop_last=True)
    nr_batches = len(test_data)
    sum_acc = 0.0
    with tqdm(test_data, total=nr_batches, leave=False) as bar:
        for data, labels in bar:
            output = inference_model(data)
            sum_acc += accuracy(output, labels)
    inference_model.detachFromDevice()
    return sum_acc / len(test_data)


def train_eager(model: nn.Module, loader, test_dataset, opts: argparse.Namespace) -> float:
    """The same loop in eager PyTorch: one optimiser step per micro-batch of each combined batch.

    Dropout draws the masks the device drew (``DropoutReplay``), so the two runs differ
    only by float rounding; ``--eager-torch-dropout`` uses torch's own random masks.
    """
    model_with_loss = TrainingModelWithLoss(model).train()
    optimizer = optim.SGD(model.parameters(), lr=opts.lr)
    replay = DropoutReplay(opts.seed)
    for _ in range(opts.epochs):
        # Iterated through tqdm as the device loop is: tqdm.auto makes an extra iterator
        # of the loader, which draws from its generator, so the batch order depends on it.
        for data, labels in tqdm(loader, total=len(loader), leave=False, desc="Eager PyTorch"):
            for x, y in zip(data.split(opts.batch_size), labels.split(opts.batch_size)):
                optimizer.zero_grad()
                with contextlib.nullcontext() if opts.eager_torch_dropout else replay.step():
                    _, loss = model_with_loss(x, y)
                    loss.backward()
                optimizer.step()
    model.eval()
    with torch.no_grad():
        test = torch.utils.data.DataLoader(test_dataset, batch_size=opts.test_batch_size, drop_last=True)
        return sum(accuracy(model(x), y) for x, y in test) / len(test)


def main(argv: list[str] | None = None) -> Result:
    opts = parse_args(argv)
    torch.manual_seed(opts.seed)
    split = load_mnist(opts.data_dir)

    model = Network()
    initial = copy.deepcopy(model)
    model_with_loss = TrainingModelWithLoss(model)
    model_opts = ipuxl.Options().deviceIterations(opts.device_iterations).randomSeed(opts.seed)
    model_opts = model_opts.anchorMode(ipuxl.AnchorMode.All)
    if opts.ipu_model:
        model_opts = model_opts.useIpuModel(True)
    print(model_with_loss)

    training_data = ipuxl.DataLoader(model_opts, split.train, batch_size=opts.batch_size, shuffle=True,
                                     drop_last=True, generator=torch.Generator().manual_seed(opts.seed))
    training_model = ipuxl.trainingModel(model_with_loss, model_opts,
                                         optimizer=optim.SGD(model.parameters(), lr=opts.lr))

    nr_batches = len(training_data)
    for epoch in tqdm(range(1, opts.epochs + 1), leave=True, desc="Epochs", total=opts.epochs):
        with tqdm(training_data, total=nr_batches, leave=False) as bar:
            for data, labels in bar:
                preds, losses = training_model(data, labels)
                mean_loss = torch.mean(losses).item()
                acc = accuracy(preds, labels)
                bar.set_description("Loss: {:0.4f} | Accuracy: {:05.2F}% ".format(mean_loss, acc))
    training_model.detachFromDevice()

    result = evaluate(model, split.test, opts.test_batch_size)
    print("Accuracy on test set: {:0.2f}%".format(result))
    eager = None
    if opts.compare_eager:
        loader = torch.utils.data.DataLoader(split.train, batch_size=opts.batch_size * opts.device_iterations,
                                             shuffle=True, drop_last=True,
                                             generator=torch.Generator().manual_seed(opts.seed))
        eager = train_eager(initial, loader, split.test, opts)
        masks = "torch's own dropout masks" if opts.eager_torch_dropout else "the device's dropout masks"
        print("Eager PyTorch accuracy on test set ({}): {:0.2f}%".format(masks, eager))
    return Result(result, eager)


if __name__ == "__main__":
    main()
