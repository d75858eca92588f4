"""Host transfers (``ipuxl.ops.host``): ``host_load`` after a ``host_store`` of the same step."""
from __future__ import annotations

import numpy as np

import ipuxl
import ipuxl.ops as ops

from ._harness import randn, run_main


def test_host_load_after_host_store():
    a0, b0 = randn((2,)), randn((2,), seed=1)

    def build(ir, load):
        a = load("a")
        ops.host_store(ipuxl.d2h_stream(a.shape, a.dtype, "first"), a)
        return {"sum": a + load("b")}

    got = run_main(build, {"a": a0, "b": b0})
    np.testing.assert_allclose(got["sum"], a0 + b0)
