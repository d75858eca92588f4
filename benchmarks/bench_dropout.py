"""What a dropout costs a step: eager PyTorch's ``F.dropout`` against ipuxl's seeded dropout.

Run:   python benchmarks/bench_dropout.py [--threads 1] [--repeats 9] [--device cpu]

Per size, in one process: eager's ``F.dropout(x, 0.1, training=True)`` (torch's generator);
ipuxl's dropout as a captured step runs it: the next seed (``modify_seed``) and
``x * dropout_mask(seed, shape, p)``, counter-based (``kernels/counter_random.py``; on CUDA one
Triton kernel each, ``kernels/counter_random_triton.py``); and, for reference, the same mask
and seed in int32 tensor ops ("tensor ops": ipuxl's path off the CPU without Triton, run here
on ``--device``) and with the mask drawn from a ``torch.Generator`` seeded from the seed words
(``torch.rand(...) >= p``, how ipuxl drew masks before the counter-based draws). Median
microseconds of ``--repeats`` timings of a loop each, after a warm-up; ratios > 1: ipuxl faster.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ipuxl.kernels import counter_random

SIZES = {"1k": (8, 128), "64k": (512, 128), "bert hidden": (8, 128, 768), "bert attention": (8, 12, 128, 128)}
P = 0.1


def _time(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median microseconds per call of ``work``."""
    loops = 5
    for _ in range(3):
        work()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(loops):
            work()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / loops * 1e6)
    return statistics.median(samples)


def _generator_mask(seed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    hi, lo = (int(v) & 0xFFFFFFFF for v in seed.tolist())
    gen = torch.Generator(device=seed.device).manual_seed((hi << 32 | lo) & 0x7FFFFFFFFFFFFFFF)
    return (torch.rand(shape, generator=gen, device=seed.device) >= P).to(torch.float32) / (1.0 - P)


def _tensor_ops_mask(seed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``dropout_mask(modify_seed(seed, 1), shape, P)`` in int32 tensor ops on the seed's device."""
    cr = counter_random
    keys = cr._device_keys(cr._device_modify(seed, cr._MIX_MODIFIER))
    keep = cr._torch_draws24(*keys, math.prod(shape), seed.device) >= math.ceil(P * 2**24)
    return keep.to(torch.float32).div_(1.0 - P).reshape(shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    seed = torch.tensor([12345, 67890], dtype=torch.int64, device=device)
    print(f"dropout p={P}, {device}, threads {torch.get_num_threads()}: median us per dropout")
    print(f"{'size':16} {'elements':>9} {'eager':>9} {'ipuxl':>9} {'tensor ops':>10} {'generator':>9} "
          f"{'eager/ipuxl':>11} {'ops/ipuxl':>9} {'gen/ipuxl':>9}")
    for name, shape in SIZES.items():
        x = torch.randn(shape, device=device)
        eager = _time(lambda: F.dropout(x, P, training=True), device, args.repeats)
        ours = _time(lambda: x * counter_random.dropout_mask(counter_random.modify_seed(seed, 1), list(shape), P,
                                                             x.dtype), device, args.repeats)
        ops = _time(lambda: x * _tensor_ops_mask(seed, shape), device, args.repeats)
        generator = _time(lambda: x * _generator_mask(counter_random.modify_seed(seed, 1), shape), device,
                          args.repeats)
        print(f"{name:16} {x.numel():>9} {eager:>9.1f} {ours:>9.1f} {ops:>10.1f} {generator:>9.1f} "
              f"{eager / ours:>11.3f} {ops / ours:>9.3f} {generator / ours:>9.3f}")


if __name__ == "__main__":
    main()
