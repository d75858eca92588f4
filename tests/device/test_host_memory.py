"""``device.host_memory``: what a compile and a first run freed goes back to the kernel once."""
from __future__ import annotations

import numpy as np

import ipuxl
import ipuxl.ops as ops
from ipuxl.device import host_memory


class _FakeLibc:
    """Counts ``malloc_trim`` calls (its ``argtypes``/``restype`` are set like ctypes')."""

    def __init__(self):
        self.trims: list[int] = []
        outer = self

        class Trim:
            argtypes = restype = None

            def __call__(self, pad):
                outer.trims.append(pad)
                return 1

        self.malloc_trim = Trim()


def _accumulating_session() -> tuple[ipuxl.Session, ipuxl.Tensor]:
    """``v += v`` each run, from ones."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable(np.ones(3, np.float32), name="v")
        ops.var_updates.accumulate_(v, v)
    return ipuxl.Session(ir, "cpu"), v


def test_the_heap_is_trimmed_once_after_a_sessions_first_run(monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(host_memory, "_libc", [libc])
    session, _ = _accumulating_session()
    with session:
        assert libc.trims == []  # compiling alone: the first run still allocates its one-time state
        session.run()
        assert libc.trims == [0]
        session.run()
        session.run()
    assert libc.trims == [0]
    other, _ = _accumulating_session()
    with other:  # each session's first run
        other.run()
    assert libc.trims == [0, 0]


def test_nothing_is_trimmed_where_the_thresholds_are_not_set(monkeypatch):
    monkeypatch.setattr(host_memory, "_libc", [])
    host_memory.release_freed_memory()  # no C library to call: a no-op, no error
    session, v = _accumulating_session()
    with session:
        session.run()
        session.run()
        np.testing.assert_array_equal(session.get_tensor_data(v), np.full(3, 4.0, np.float32))
