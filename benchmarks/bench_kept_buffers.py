"""What the device's memory plan saves: large kernels writing into a fresh tensor against
writing into a buffer kept between calls (``ipuxl.device.memory_plan``).

Run:   python benchmarks/bench_kept_buffers.py [--threads 1] [--repeats 7] [--quick]

Each row times one aten kernel at a language model's sizes (GPT-2's 50257-token head over
2 x 128 tokens, BERT's 30522-token table), once as the functional op (a new result each
call: on the CPU a large allocation comes as fresh pages from the operating system, faulted
in and zeroed on first write) and once as its ``out=`` form into a tensor made once, as the
memory plan runs it. Reported: the median ms of ``--repeats`` timings after one warm-up
each, and fresh / kept (> 1: the kept buffer is faster). Both forms' results are compared
(equal, bit for bit). ``--quick``: small sizes, 2 repeats (a check that it runs).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from ipuxl.kernels.embedding import embedding_grad_into

aten = torch.ops.aten


def median_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def cases(tokens: int, vocab: int, width: int, table: int) -> list[tuple[str, Callable, Callable]]:
    """(name, fresh, kept) per kernel; ``kept`` writes into a buffer made here, once."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(tokens, width, generator=gen), torch.randn(vocab, width, generator=gen)
    logits = torch.randn(tokens, vocab, generator=gen)
    ids, rows = torch.randint(0, table, (tokens,), generator=gen), torch.randn(tokens, width, generator=gen)
    out_logits, out_lsm = torch.empty(tokens, vocab), torch.empty(tokens, vocab)
    out_dw, out_table = torch.empty(vocab, width), torch.empty(table, width)
    return [
        ("logits mm", lambda: aten.mm(x, w.t()), lambda: aten.mm.out(x, w.t(), out=out_logits)),
        ("log_softmax", lambda: aten._log_softmax(logits, 1, False),
         lambda: aten._log_softmax.out(logits, 1, False, out=out_lsm)),
        ("head weight grad mm", lambda: aten.mm(logits.t(), x), lambda: aten.mm.out(logits.t(), x, out=out_dw)),
        ("embedding grad", lambda: aten.embedding_dense_backward(rows, ids, table, -1, False),
         lambda: embedding_grad_into(out_table, rows, ids, -1)),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    sizes = (16, 2000, 64, 3000) if opts.quick else (256, 50257, 768, 30522)
    repeats = 2 if opts.quick else opts.repeats
    print(f"threads {torch.get_num_threads()}, {sizes[0]} tokens, head {sizes[1]} x {sizes[2]}, "
          f"table {sizes[3]} x {sizes[2]}, median of {repeats}")
    print(f"{'kernel':<20} {'fresh ms':>9} {'kept ms':>8} {'fresh/kept':>10}  equal")
    for name, fresh, kept in cases(*sizes):
        same = torch.equal(fresh(), kept())
        t_fresh, t_kept = median_ms(fresh, repeats), median_ms(kept, repeats)
        print(f"{name:<20} {t_fresh:>9.2f} {t_kept:>8.2f} {t_fresh / t_kept:>10.2f}  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
