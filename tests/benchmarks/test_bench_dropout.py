"""``benchmarks/bench_dropout.py``: its reference columns time the mask ipuxl draws, and it runs."""
from __future__ import annotations

import re
import sys

import torch

from ipuxl.kernels import counter_random
from tests.benchmarks._run import ROOT, run_script

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_dropout  # noqa: E402


def test_the_tensor_ops_column_draws_ipuxls_mask():
    seed = torch.tensor([12345, 67890])
    expected = counter_random.dropout_mask(counter_random.modify_seed(seed, 1), [64, 77], bench_dropout.P,
                                           torch.float32)
    assert torch.equal(bench_dropout._tensor_ops_mask(seed, (64, 77)), expected)


def test_the_benchmark_prints_a_row_per_size():
    out = run_script("bench_dropout.py", "--repeats", "1")
    rows = re.findall(r"^(1k|64k|bert hidden|bert attention)\s+\d+(\s+\d+\.\d+){7}$", out, re.MULTILINE)
    assert len(rows) == len(bench_dropout.SIZES), out
