"""popxl.addons' variable factories with ``memmap_dir``: each variable's host value is an
``np.memmap`` of ``<dir>/<name>.npy``; a step's in-place update, read back to the host,
is in the file (eager torch computes the expected values)."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops

SHAPE = (2, 3)


def _values(start):
    """An endless data source: start, start + 1, ... (float32 arrays of SHAPE)."""
    counter = itertools.count(start)
    return (np.full(SHAPE, float(k), np.float32) + np.arange(6, dtype=np.float32).reshape(SHAPE) for k in counter)


def _program(source, memmap_dir, read_only_if_exists=False, prefix=None, replication=1, grouping=None):
    """Factories "w" and "b" from ``source``; the main graph adds ``x`` to both in place."""
    ir = ipuxl.Ir(replication=replication)
    with ir.main_graph:
        group = ir.replica_grouping(group_size=1) if grouping else None
        facts = addons.NamedVariableFactories(
            w=addons.VariableFactory(source, name="w", replica_grouping=group),
            b=addons.VariableFactory(source, name="b", replica_grouping=group))
        variables = facts.init(prefix=prefix, memmap_dir=memmap_dir, read_only_if_exists=read_only_if_exists)
        stream = ipuxl.h2d_stream(SHAPE, ipuxl.float32, "x")
        x = ops.host_load(stream)
        for v in variables.tensors:
            ops.var_updates.accumulate_(v, x)
    return ir, variables, stream


def _file(path, shape=SHAPE):
    return np.fromfile(path, dtype=np.float32).reshape(shape)


def test_init_keeps_each_host_value_in_its_file_and_the_session_writes_it_back(tmp_path):
    source = _values(0)
    ir, variables, stream = _program(source, str(tmp_path / "weights"), prefix="layer")
    files = sorted(os.listdir(tmp_path / "weights"))
    assert files == ["layer.b.npy", "layer.w.npy"]
    # each factory read its first value when made (w: 0, then b: 1), as upstream's peek
    b0, w0 = (torch.from_numpy(_file(tmp_path / "weights" / f)) for f in files)
    first = torch.arange(6, dtype=torch.float32).reshape(SHAPE)
    torch.testing.assert_close(w0, first)
    torch.testing.assert_close(b0, first + 1.0)
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({stream: x})
        session.run({stream: x})
    for name, before in (("layer.b.npy", b0), ("layer.w.npy", w0)):  # eager: two accumulations of x
        torch.testing.assert_close(torch.from_numpy(_file(tmp_path / "weights" / name)), before + 2 * torch.from_numpy(x))
    assert isinstance(session.get_tensor_data(variables.w), np.memmap)


def test_an_existing_file_is_reused_and_the_data_source_is_not_advanced(tmp_path):
    directory = str(tmp_path)
    ir, variables, stream = _program(_values(0), directory)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({stream: np.ones(SHAPE, np.float32)})
    saved = {n: _file(tmp_path / f"{n}.npy").copy() for n in ("b", "w")}
    source = _values(100)
    ir2, variables2, _ = _program(source, directory)
    for n in ("b", "w"):
        np.testing.assert_array_equal(ipuxl.Session(ir2, "cpu").get_tensor_data(variables2[n]), saved[n])
    # each factory peeked one value when made; the files stood in for every later draw
    np.testing.assert_array_equal(next(source), np.full(SHAPE, 102.0, np.float32) + np.arange(6).reshape(SHAPE))


def test_read_only_if_exists_never_writes_the_file(tmp_path):
    directory = str(tmp_path)
    _program(_values(0), directory)  # creates the files
    before = _file(tmp_path / "w.npy").copy()
    ir, variables, stream = _program(_values(50), directory, read_only_if_exists=True)
    x = np.full(SHAPE, 3.0, np.float32)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({stream: x})
        got = session.get_tensor_data(variables.w)
    np.testing.assert_array_equal(_file(tmp_path / "w.npy"), before)
    np.testing.assert_array_equal(got, before + x)  # the session's host value is a private copy


def test_replica_groups_store_one_value_per_group(tmp_path):
    ir, variables, stream = _program(_values(0), str(tmp_path), replication=2, grouping=True)
    data = _file(tmp_path / "w.npy", (2, *SHAPE))
    # one draw per group (w: its first value 0; after b's two draws, 3)
    np.testing.assert_array_equal(data - np.arange(6).reshape(SHAPE), np.stack([np.zeros(SHAPE), np.full(SHAPE, 3.0)]))
    x = np.stack([np.full(SHAPE, 1.0), np.full(SHAPE, 5.0)]).astype(np.float32)  # one slice per replica
    with ipuxl.Session(ir, "cpu") as session:
        session.run({stream: x})
    after = _file(tmp_path / "w.npy", (2, *SHAPE))
    np.testing.assert_array_equal(after, data + x)


def test_create_tensor_and_next_memmap_take_upstreams_arguments(tmp_path):
    ir = ipuxl.Ir()
    with ir.main_graph:
        factory = addons.VariableFactory(lambda: np.arange(4, dtype=np.float64), name="v")
        t = factory.create_tensor("v", empty=True, memmap_dir=str(tmp_path))
    assert t.dtype == ipuxl.float32  # 64-bit data downcast, and the file holds the variable's dtype
    np.testing.assert_array_equal(np.fromfile(tmp_path / "v.npy", np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError):  # a read-only map cannot be written
        factory.next_memmap(str(tmp_path), "v", read_only_if_exists=True)[0] = 1.0
