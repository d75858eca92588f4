"""Variables whose data is an np.memmap: the file is the host buffer (PopXL's behaviour)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
from ipuxl.errors import InvalidValueError


def _onchip(data, ir, **kw):
    w = ipuxl.variable(data, name="w", **kw)
    return w, w, None


def _remote(data, ir, **kw):
    buffer = ipuxl.remote_buffer(data.shape, ipuxl.float32)
    w = ipuxl.remote_variable(data, buffer, 0, name="w", **kw)
    return w, ipuxl.ops.remote_load(buffer, 0), lambda t: ipuxl.ops.remote_store(buffer, 0, t)


def _sharded(data, ir, **kw):
    w, shard = ipuxl.replica_sharded_variable(data, name="w", **kw)
    return w, shard, None


def _remote_sharded(data, ir, **kw):
    buffer = ipuxl.replica_sharded_buffer(data.shape, ipuxl.float32)
    w = ipuxl.remote_replica_sharded_variable(data, buffer, 0, name="w", **kw)
    return w, ipuxl.ops.remote_load(buffer, 0), lambda t: ipuxl.ops.remote_store(buffer, 0, t)


KINDS = [_onchip, _remote, _sharded, _remote_sharded]


@pytest.mark.parametrize("make", KINDS, ids=lambda f: f.__name__.strip("_"))
def test_the_memmap_is_the_host_buffer_and_is_flushed(tmp_path, make, monkeypatch):
    path = str(tmp_path / "w.bin")
    data = np.memmap(path, dtype=np.float32, shape=(6, 4), mode="w+")
    data[:] = np.arange(24, dtype=np.float32).reshape(6, 4)
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph, ipuxl.in_sequence():
        w, loaded, store = make(data, ir)
        loaded += 1  # in place (ops.add_), as PopXL's `+=`
        if store is not None:
            store(loaded)
    flushes = []
    real_flush = data.flush
    monkeypatch.setattr(data, "flush", lambda: (flushes.append(1), real_flush())[1], raising=False)
    with ipuxl.Session(ir, "ipu_model") as session:
        session.run()
    assert flushes, "weights_to_host should flush the memmap"
    got = session.get_tensor_data(w)
    assert got is data and w._memmap_arr is data  # the very object the variable was made from
    expected = torch.arange(24, dtype=torch.float32).reshape(6, 4) + 1
    torch.testing.assert_close(torch.from_numpy(np.array(got)), expected)
    on_disk = np.fromfile(path, dtype=np.float32).reshape(6, 4)
    torch.testing.assert_close(torch.from_numpy(on_disk), expected)


@pytest.mark.parametrize("make", KINDS, ids=lambda f: f.__name__.strip("_"))
def test_a_memmap_needing_a_conversion_is_refused(tmp_path, make):
    ir = ipuxl.Ir(replication=2)
    floats = np.memmap(str(tmp_path / "a.bin"), dtype=np.float32, shape=(4,), mode="w+")
    fortran = np.memmap(str(tmp_path / "b.bin"), dtype=np.float32, shape=(4, 4), mode="w+", order="F")
    doubles = np.memmap(str(tmp_path / "c.bin"), dtype=np.float64, shape=(4,), mode="w+")
    with ir.main_graph:
        with pytest.raises(InvalidValueError, match="^When passing a memory-mapped NumPy array, the `dtype` param"):
            make(floats, ir, dtype=ipuxl.float16)
        with pytest.raises(ValueError, match="^When passing a memory-mapped NumPy array, it must already be in C-"):
            make(fortran, ir)
        with pytest.raises(ValueError, match="^When passing a memory-mapped NumPy array, the dtype None is not "
                                             "supported, as it requires downcasting"):
            make(doubles, ir)


def test_an_ordinary_array_is_still_copied():
    data = np.zeros((2,), np.float32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(data)
        w += 1
    with ipuxl.Session(ir) as session:
        session.run()
    assert session.get_tensor_data(w) is not data and not data.any() and w._memmap_arr is None
