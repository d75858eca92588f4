"""Where one of ``bench_transformers``' models spends a call: ipuxl against eager, under
``torch.profiler``.

Run:   python benchmarks/profile_transformer.py [--model gpt2] [--calls 3] [--top 15] [--tiny]

Each side (ipuxl's ``trainingModel``, eager PyTorch with AdamW; built, fed and stepped as
in ``bench_transformers.py``, on CUDA where present) runs two warm-up calls, then
``--calls`` calls under the profiler. Printed per side: ms per call (wall, synchronized),
the ops with the most self device time (CUDA) or self CPU time (CPU), and how often the
host waited for the GPU (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, and
blocking ``cudaMemcpy`` calls), per call.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_transformers as bench  # noqa: E402

_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def profile_side(side: str, name: str, calls: int, top: int) -> None:
    run = bench.make_side(side, bench.build(name))
    data = bench.make_data(name, 2)
    for call in data:
        run(call)
    bench.synchronize()
    cuda = bench.DEVICE.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(calls):
            run(data[i % len(data)])
        bench.synchronize()
    ms = (time.perf_counter() - start) / calls * 1e3
    events = prof.key_averages()
    waits = {k: sum(e.count for e in events if e.key == k) / calls for k in _WAITS}
    print(f"\n== {name} {side}: {ms:.1f} ms per call (profiled); host waits per call: "
          + ", ".join(f"{k} {v:g}" for k, v in waits.items()))
    print(events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=top,
                       max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=list(bench.MODELS))
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--tiny", action="store_true", help="toy sizes (bench_transformers --tiny)")
    opts = parser.parse_args()
    bench.SIZES = bench.TINY if opts.tiny else bench.FULL
    bench.DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for side in ("ipuxl", "eager"):
        profile_side(side, opts.model, opts.calls, opts.top)


if __name__ == "__main__":
    main()
