"""Seed 003's PopTorch CNN split over 2 IPUs in 2 pipeline stages, written with ipuxl.

The network is seed 003's (two conv blocks, a 128-unit dense layer with dropout, a
10-way classifier), annotated the PopTorch way: ``with poptorch.Block("conv")`` around
the convolutions and ``with poptorch.Block("dense")`` around the dense layers and the
loss. ``PipelinedExecution(Stage("conv").ipu(0), Stage("dense").ipu(1))`` makes them a
2-stage pipeline over IPUs 0 and 1; training runs 2 x 2 - 1 = 3 pipeline stages (the
backward stages run on the same IPUs in reverse order), so PopTorch requires
``gradientAccumulation`` >= 3: 4 here. Trained with ``trainingModel`` and SGD, then
evaluated with ``inferenceModel`` (the same strategy: a 2-stage inference pipeline
over the device iterations).

``--compare-unsplit`` trains the same network from the same weights, options and seed
without the strategy (every block on one IPU, no pipeline): the accuracies agree,
since a pipeline changes where and when each stage runs, not what it computes. The
program's report (``training_model.report()``) shows each IPU's memory, FLOPs and
copies and the pipeline schedule.

Data: the local MNIST files (``--data-dir``, default ``$IPUXL_DATA``); offline, the
training images are a part of the test set (``ipuxl.datasets.load_mnist``).

Run: ``python examples/pipelined_mnist.py --data-dir ../shared/datasets [--epochs 1] [--compare-unsplit]``
"""
from __future__ import annotations

import argparse
import copy
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.optim as optim
from tqdm.auto import tqdm

import ipuxl.poptorch_compat as poptorch
from ipuxl.datasets import load_mnist


class ConvBlock(nn.Module):
    def __init__(self, in_channels, num_filters, kernel_size, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.pool(self.conv(x)))


class Network(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = ConvBlock(1, 32, 3, 2)
        self.layer2 = ConvBlock(32, 64, 3, 2)
        self.layer3 = nn.Linear(1600, 128)
        self.layer3_act = nn.ReLU()
        self.layer3_dropout = torch.nn.Dropout(0.5)
        self.layer4 = nn.Linear(128, 10)

    def forward(self, x):
        with poptorch.Block("conv"):
            x = self.layer1(x)
            x = self.layer2(x)
        with poptorch.Block("dense"):
            x = x.view(-1, 1600)
            x = self.layer3_act(self.layer3(x))
            x = self.layer4(self.layer3_dropout(x))
        return x


class TrainingModelWithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, args, labels=None):
        output = self.model(args)
        if labels is None:
            return output
        with poptorch.Block("dense"):
            loss = self.loss(output, labels)
        return output, loss


def accuracy(predictions, labels):
    _, ind = torch.max(predictions, 1)
    labels = labels[-predictions.size()[0]:]
    return torch.sum(torch.eq(ind, labels)).item() / labels.size()[0] * 100.0


class Result(NamedTuple):
    accuracy: float
    unsplit_accuracy: float | None
    report: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Seed 003's CNN pipelined over 2 IPUs on ipuxl")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
    parser.add_argument("--gradient-accumulation", type=int, default=4, help="micro-batches per step (>= 3)")
    parser.add_argument("--device-iterations", type=int, default=10)
    parser.add_argument("--test-batch-size", type=int, default=80)
    parser.add_argument("--train-images", type=int, default=None, help="train on the first N images only")
    parser.add_argument("--test-images", type=int, default=None, help="test on the first N images only")
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: $IPUXL_DATA or ./data)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--compare-unsplit", action="store_true",
                        help="also train the network without the pipeline (one IPU) and print both accuracies")
    return parser.parse_args(argv)


def options(opts: argparse.Namespace, pipelined: bool) -> poptorch.Options:
    model_opts = poptorch.Options().deviceIterations(opts.device_iterations).randomSeed(opts.seed)
    model_opts.outputMode(poptorch.OutputMode.All)
    model_opts.Training.gradientAccumulation(opts.gradient_accumulation)
    if pipelined:
        model_opts.setExecutionStrategy(poptorch.PipelinedExecution(
            poptorch.Stage("conv").ipu(0),
            poptorch.Stage("dense").ipu(1)))
    else:  # every block in one stage on IPU 0: the unsplit model
        model_opts.setExecutionStrategy(poptorch.ShardedExecution(poptorch.Stage("conv", "dense").ipu(0)))
    return model_opts


def train_and_test(model: Network, split, opts: argparse.Namespace, pipelined: bool) -> tuple[float, str]:
    """Train ``model`` with ``trainingModel``, then test it with ``inferenceModel``."""
    model_opts = options(opts, pipelined)
    train = split.train
    if opts.train_images is not None:
        train = torch.utils.data.Subset(train, range(min(opts.train_images, len(train))))
    training_data = poptorch.DataLoader(model_opts, train, batch_size=opts.batch_size, shuffle=True,
                                        drop_last=True, generator=torch.Generator().manual_seed(opts.seed))
    training_model = poptorch.trainingModel(TrainingModelWithLoss(model), model_opts,
                                            optimizer=optim.SGD(model.parameters(), lr=opts.lr))
    label = "pipelined" if pipelined else "unsplit"
    for _ in range(opts.epochs):
        with tqdm(training_data, total=len(training_data), leave=False, desc=label) as bar:
            for data, labels in bar:
                preds, losses = training_model(data, labels)
                bar.set_description(f"{label} Loss: {torch.mean(losses).item():0.4f} | "
                                    f"Accuracy: {accuracy(preds, labels):05.2f}%")
    report = str(training_model.report())
    training_model.detachFromDevice()

    inference_opts = model_opts.clone()
    inference_opts.Training.gradientAccumulation(1)
    inference_opts.deviceIterations(opts.device_iterations)
    inference_model = poptorch.inferenceModel(model, inference_opts)
    test = split.test
    if opts.test_images is not None:
        test = torch.utils.data.Subset(test, range(min(opts.test_images, len(test))))
    test_data = poptorch.DataLoader(inference_opts, test, batch_size=opts.test_batch_size, drop_last=True)
    if len(test_data) == 0:
        raise SystemExit(f"no test batch: fewer than {opts.test_batch_size} x {opts.device_iterations} test images")
    total = sum(accuracy(inference_model(data), labels) for data, labels in test_data)
    inference_model.detachFromDevice()
    return total / len(test_data), report


def main(argv: list[str] | None = None) -> Result:
    opts = parse_args(argv)
    torch.manual_seed(opts.seed)
    split = load_mnist(opts.data_dir)
    model = Network()
    unsplit_model = copy.deepcopy(model)

    result, report = train_and_test(model, split, opts, pipelined=True)
    print(report)
    print("Accuracy on test set (2 IPUs, pipelined): {:0.2f}%".format(result))
    unsplit = None
    if opts.compare_unsplit:
        unsplit, _ = train_and_test(unsplit_model, split, opts, pipelined=False)
        print("Accuracy on test set (unsplit, 1 IPU): {:0.2f}%".format(unsplit))
    return Result(result, unsplit, report)


if __name__ == "__main__":
    main()
