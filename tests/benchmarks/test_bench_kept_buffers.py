"""``benchmarks/bench_kept_buffers.py`` runs in its quick mode, and every kernel written into a
kept buffer gives the functional op's result bit for bit."""
from __future__ import annotations

import re

from tests.benchmarks._run import run_script


def test_kept_buffers_give_the_same_results():
    out = run_script("bench_kept_buffers.py", "--quick")
    rows = re.findall(r"^(.+?)\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+(yes|NO)$", out, re.MULTILINE)
    assert len(rows) == 4 and all(equal == "yes" for _, equal in rows), out
