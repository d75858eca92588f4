"""Memory of wrappers made and dropped in a loop, against eager PyTorch in the same run.

Run:   python benchmarks/bench_wrappers.py [--model resnet18] [--epochs 8] [--batch 2]

A common PopTorch pattern evaluates with a fresh ``inferenceModel(model)`` every epoch
and drops it. Each wrapper owns a compiled program (and, on a device that copies the
weights, a copy of them); nothing should outlive the wrapper. Per epoch this script

* eager: runs ``model.eval()`` under ``torch.no_grad()`` on the same batch;
* ipuxl: makes ``ipuxl.inferenceModel(model)``, runs it on the batch, drops it
  (``del`` and ``gc.collect()``),

and prints the resident memory (RSS, Linux ``/proc/self/statm``) after each epoch and
the growth per epoch of each side, from epoch 3 on (the first epochs allocate caches).
The outputs of the last epoch must agree.
"""
from __future__ import annotations

import argparse
import gc
import os

import torch
import torchvision

import ipuxl


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def growth(samples: list[float]) -> float:
    start = min(2, len(samples) - 1)
    return (samples[-1] - samples[start]) / max(1, len(samples) - 1 - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", help="a torchvision classification model")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=10)
    x = torch.randn(args.batch, 3, 64, 64)
    eager, wrapped = [], []
    for _ in range(args.epochs):
        model.eval()
        with torch.no_grad():
            expected = model(x)
        gc.collect()
        eager.append(rss_mib())
    for _ in range(args.epochs):
        inference = ipuxl.inferenceModel(model)
        out = inference(x)
        del inference
        gc.collect()
        wrapped.append(rss_mib())
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    print(f"torch {torch.__version__}, {args.model}, batch {args.batch}, {args.epochs} epochs; ipuxl from "
          f"{os.path.dirname(ipuxl.__file__)}")
    print("eager RSS MiB per epoch:        ", " ".join(f"{v:.0f}" for v in eager))
    print("ipuxl wrapper RSS MiB per epoch:", " ".join(f"{v:.0f}" for v in wrapped))
    print(f"growth per epoch: eager {growth(eager):.1f} MiB, ipuxl (new wrapper each epoch) "
          f"{growth(wrapped):.1f} MiB")


if __name__ == "__main__":
    main()
