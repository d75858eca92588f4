"""The indexing ops (``ipuxl.ops.indexing``: dynamic slices and updates, scatters, top-k,
histogram), forward and gradient, against eager PyTorch / numpy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops

from ._harness import case, check_op, randn, run_main, run_op


def idx(*values, dtype=np.uint32):
    return np.array(values, dtype=dtype)


def _dyn_slice_ref(x, index, axes, sizes):
    key = [slice(None)] * x.dim()
    for i, (a, s) in enumerate(zip(axes, sizes)):
        start = min(max(int(index[i]), 0), x.shape[a] - s)
        key[a] = slice(start, start + s)
    return tuple(key)


def _dyn_update_ref(x, index, u, axes, sizes):
    out = x.clone()
    out[_dyn_slice_ref(x, index, axes, sizes)] = u
    return out


INDEXING = [
    case("dynamic_slice", lambda x, i: ops.dynamic_slice(x, i, [0, 2], [2, 3], False),
         lambda x, i: x[_dyn_slice_ref(x, i, [0, 2], [2, 3])], (4, 3, 5), idx(1, 2)),
    case("dynamic_slice-one-axis", lambda x, i: ops.dynamic_slice(x, i, [1], [2], True),
         lambda x, i: x[:, 2:4], (3, 5), idx(2)),
    case("dynamic_slice-clamped", lambda x, i: ops.dynamic_slice(x, i, [0], [3], False),
         lambda x, i: x[1:4], (4, 2), idx(7)),
    case("dynamic_update", lambda x, i, u: ops.dynamic_update(x, i, u, [2, 0], [2, 1], False),
         lambda x, i, u: _dyn_update_ref(x, i, u, [2, 0], [2, 1]), (3, 2, 4), idx(1, 2), (1, 2, 2)),
    case("dynamic_update_", lambda x, i, u: ops.dynamic_update_(ops.identity(x), i, u, [1], [2], False),
         lambda x, i, u: _dyn_update_ref(x, i, u, [1], [2]), (3, 4), idx(1), (3, 2)),
    case("scatter", lambda x, i, v: ops.scatter(x, i, v, 1),
         lambda x, i, v: torch.scatter(x, 1, i.long(), v), (3, 4), np.array([[0, 3], [1, 2], [3, 0]], np.int32),
         (3, 2)),
    case("scatter-axis0-negative", lambda x, i, v: ops.scatter(x, i, v),
         lambda x, i, v: torch.scatter(x, 0, (i.long() % 4), v), (4, 2), np.array([[-1, 0], [1, -4]], np.int32),
         (2, 2)),
    case("scatter_reduce-sum", lambda d, i: ops.scatter_reduce(d, i, "sum", axis_size=3),
         lambda d, i: torch.zeros(3, 2, dtype=d.dtype).index_add(0, i.long(), d), (5, 2),
         np.array([0, 2, 0, 1, 2], np.int32)),
    case("scatter_reduce-max-initial", lambda d, i, init: ops.scatter_reduce(d, i, "max", init, axis=1),
         lambda d, i, init: init.scatter_reduce(1, i.long(), d, "amax"), (2, 4),
         np.array([[0, 1, 1, 2], [2, 2, 0, 0]], np.int32), (2, 3)),
    case("scatter_reduce-min", lambda d, i: ops.scatter_reduce(d, i, "min", axis_size=3),
         lambda d, i: torch.zeros(3, dtype=d.dtype).scatter_reduce(0, i.long(), d, "amin", include_self=False),
         (4,), np.array([2, 0, 2, 0], np.int32)),
    case("scatter_reduce-none", lambda d, i: ops.scatter_reduce(d, i, "none", axis_size=4),
         lambda d, i: torch.zeros(4, 2, dtype=d.dtype).index_copy(0, i.long(), d), (2, 2), np.array([3, 1], np.int32)),
    case("topk-largest", lambda x: ops.topk(x, 2, 1, True, True),
         lambda x: (torch.topk(x, 2, 1).values, torch.topk(x, 2, 1).indices.int()), (3, 5)),
    case("topk-smallest-axis0", lambda x: ops.topk(x, 3, 0, False, True),
         lambda x: (torch.topk(x, 3, 0, False).values, torch.topk(x, 3, 0, False).indices.int()), (4, 2)),
    case("tied_gather", lambda x, i: ops.tied_gather(x, i), lambda x, i: x[i.long()], (5, 3),
         np.array([[4, 0], [2, 2]], np.int32)),
    case("tied_gather-axis1-zero_OOR", lambda x, i: ops.tied_gather(x, i, 1, zero_OOR=True),
         lambda x, i: torch.cat([x[:, :1], torch.zeros_like(x[:, :1])], 1), (2, 3), np.array([0, 5], np.int32)),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", INDEXING)
def test_indexing(ipuxl_fn, torch_fn, inputs, kwargs):
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


def test_topk_unsorted_returns_the_same_set():
    x = randn((2, 6))
    values, indices = run_op(lambda t: ops.topk(t, 3, -1, True, False), [x], grad=False)["out"]
    ref = torch.topk(torch.from_numpy(x), 3, -1)
    np.testing.assert_allclose(np.sort(values, -1), np.sort(ref.values.numpy(), -1))
    np.testing.assert_array_equal(np.take_along_axis(x, indices.astype(np.int64), -1), values)


def test_dynamic_update_inplace_writes_the_variable():
    x0, u0 = randn((4, 3)), randn((2, 3), seed=1)

    def build(ir, load):
        x = ipuxl.variable(x0, ipuxl.float64, name="x")
        ops.dynamic_update_(x, load("i"), load("u"), [0], [2], True)
        return {"x": x}

    got = run_main(build, {"i": idx(1), "u": u0})
    expected = x0.copy()
    expected[1:3] = u0
    np.testing.assert_allclose(got["x"], expected)


@pytest.mark.parametrize("absolute", [False, True])
def test_histogram(absolute):
    x = randn((4, 5)) * 2
    levels = [-1.0, 0.0, 0.5, 2.0]
    out = run_op(lambda t: ops.histogram(t, levels, absolute), [x], grad=False)["out"][0]
    data = np.abs(x) if absolute else x
    expected = np.bincount(np.searchsorted(levels, data.reshape(-1), side="right"), minlength=len(levels) + 1)
    assert out.dtype == np.uint32
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("build, error, fragment", [
    (lambda x, i: ops.dynamic_slice(x, i, [0, 5], [1, 1], False), ValueError, "out of range"),
    (lambda x, i: ops.dynamic_slice(x, i, [0, 1], [1, 9], False), ValueError, "sizes"),
    (lambda x, i: ops.dynamic_slice(x, i, [0], [1], False), ValueError, "index 'i'"),
    (lambda x, i: ops.dynamic_update(x, i, x, [0, 1], [1, 1], False), ValueError, "shape of the slice"),
    (lambda x, i: ops.scatter_reduce(x, i, "sum"), ValueError, "axis_size"),
    (lambda x, i: ops.scatter_reduce(x, i, "mean", axis_size=2), ValueError, "reduction"),
    (lambda x, i: ops.scatter(x, i, x), ValueError, "one shape"),
    (lambda x, i: ops.topk(x, 5, 0, True, True), ValueError, "k=5"),
    (lambda x, i: ops.histogram(x, [1.0, 0.5], False), ValueError, "monotonically increasing"),
], ids=["axes", "sizes", "index", "update", "axis_size", "reduction", "scatter", "topk", "histogram"])
def test_indexing_errors(build, error, fragment):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((3, 4), np.float32), name="x")
        i = ipuxl.variable(idx(0, 1), name="i")
        with pytest.raises(error, match=fragment):
            build(x, i)
