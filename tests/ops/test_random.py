"""The random ops (``ipuxl.ops.random``): dropout, shaped dropout, uniform and normal draws, seeds
(PopXL's), against eager PyTorch and statistics."""
from __future__ import annotations

import math

import numpy as np
import pytest

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import InvalidArgumentError

from ._harness import check_op, randn, run_main, run_op


def _seed(value=0):
    return ipuxl.create_seeds(value)


def test_dropout_p0_is_identity():
    check_op(lambda x, s: ops.dropout(x, s, 0.0), lambda x, s: x.clone(), [(3, 4), _seed()])


def test_dropout_mask_scale_and_seeds():
    p = 0.3
    x = randn((64, 32), np.float32, low=1.0, high=2.0)  # never 0, so 0 in the output marks a dropped element

    def build(ir, load):
        xt, s1, s2 = load("x"), load("s1"), load("s2")
        return {"a": ops.dropout(xt, s1, p), "b": ops.dropout(xt, s1, p), "c": ops.dropout(xt, s2, p)}

    got = run_main(build, {"x": x, "s1": _seed(1), "s2": _seed(2)})
    a, b, c = got["a"], got["b"], got["c"]
    assert a.dtype == np.float32 and a.shape == x.shape
    kept = a != 0
    np.testing.assert_allclose(a[kept], x[kept] / (1 - p), rtol=1e-6)
    assert abs(kept.mean() - (1 - p)) < 0.03
    np.testing.assert_array_equal(a, b)  # same seed, same mask
    assert (kept != (c != 0)).mean() > 0.2  # another seed, another mask


def test_dropout_gradient_reuses_the_mask():
    p = 0.5
    x = randn((32, 16), low=1.0, high=2.0)
    got = run_op(lambda t, s: ops.dropout(t, s, p), [x, _seed(5)])
    (y,), ((_, dy),), (dx,) = got["out"], got["dy"], got["grad"]
    kept = y != 0
    assert 0.35 < kept.mean() < 0.65
    np.testing.assert_allclose(y, np.where(kept, x / (1 - p), 0.0), rtol=1e-12)
    np.testing.assert_allclose(dx, np.where(kept, dy / (1 - p), 0.0), rtol=1e-12)


def test_random_ops_check_the_seed():
    ir = ipuxl.Ir()
    with ir.main_graph, pytest.raises(InvalidArgumentError, match="seed"):
        ops.random_uniform(ipuxl.variable(np.zeros((2,), np.float32)), (3,))


@pytest.mark.parametrize("dtype", [ipuxl.float32, ipuxl.float16])
def test_random_uniform(dtype):
    shape, low, high = (100, 100), -2.0, 3.0

    def build(ir, load):
        s = load("s")
        s2 = ops.split_random_seed(s)[0]
        return {"a": ops.random_uniform(s, shape, low, high, dtype), "b": ops.random_uniform(s, shape, low, high,
                                                                                              dtype),
                "c": ops.random_uniform(s2, shape, low, high, dtype), "d": ops.random_uniform(s, (3,))}

    got = run_main(build, {"s": _seed(3)})
    a = got["a"]
    assert a.shape == shape and a.dtype == ipuxl.dtypes.to_numpy_dtype(dtype)
    assert got["d"].shape == (3,) and got["d"].dtype == np.float32 and ((got["d"] >= 0) & (got["d"] < 1)).all()
    assert a.min() >= low and a.max() <= high
    assert abs(a.astype(np.float64).mean() - (low + high) / 2) < 0.05
    assert abs(a.astype(np.float64).std() - (high - low) / math.sqrt(12)) < 0.05
    np.testing.assert_array_equal(a, got["b"])
    assert (a != got["c"]).mean() > 0.99


def test_random_normal():
    shape, mean, std = (200, 100), 1.0, 2.0

    def build(ir, load):
        s1, s2 = load("s1"), load("s2")
        return {"a": ops.random_normal(s1, shape, mean, std), "b": ops.random_normal(s1, shape, mean, std),
                "c": ops.random_normal(s2, shape, mean, std),
                "h": ops.random_normal(s1, (4,), dtype=ipuxl.float16)}

    got = run_main(build, {"s1": _seed(4), "s2": _seed(5)})
    a = got["a"]
    assert a.shape == shape and a.dtype == np.float32
    assert got["h"].shape == (4,) and got["h"].dtype == np.float16
    assert abs(a.mean() - mean) < 0.05 and abs(a.std() - std) < 0.05
    assert abs(np.mean(((a - mean) / std) ** 3)) < 0.1  # symmetric
    np.testing.assert_array_equal(a, got["b"])
    assert (a != got["c"]).mean() > 0.99


def test_random_depends_on_the_fed_seed():
    def build(ir, load):
        return {"u": ops.random_uniform(load("s"), (50,))}

    a = run_main(build, {"s": _seed(1)})["u"]
    b = run_main(build, {"s": _seed(1)})["u"]
    c = run_main(build, {"s": _seed(2)})["u"]
    np.testing.assert_array_equal(a, b)
    assert (a != c).all()


def test_split_random_seed():
    def build(ir, load):
        s = load("s")
        parts = ops.split_random_seed(s, 3)
        again = ops.split_random_seed(s, 2)
        return {"s": ops.identity(s), **{f"p{i}": t for i, t in enumerate(parts)},
                **{f"q{i}": t for i, t in enumerate(again)}}

    seed = _seed(7)
    got = run_main(build, {"s": seed})
    parts = [got[f"p{i}"] for i in range(3)]
    for p in parts:
        assert p.shape == (2,) and p.dtype == np.uint32
    distinct = {tuple(p.tolist()) for p in parts} | {tuple(seed.tolist())}
    assert len(distinct) == 4, f"seeds are not distinct: {distinct}"
    np.testing.assert_array_equal(got["q0"], parts[0])  # deterministic
    np.testing.assert_array_equal(got["q1"], parts[1])
    other = run_main(build, {"s": _seed(8)})
    assert tuple(other["p0"].tolist()) != tuple(parts[0].tolist())


def test_create_seeds():
    a, b, c = ipuxl.create_seeds(1), ipuxl.create_seeds(1), ipuxl.create_seeds(2)
    assert a.shape == (2,) and a.dtype == np.uint32
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    many = ops.create_seeds(1, batches_per_step=4, replicas=2)
    assert many.shape == (4, 2, 2) and many.dtype == np.uint32
    assert len({tuple(s) for s in many.reshape(-1, 2).tolist()}) == 8


def test_create_seeds_are_popxls():
    # PopXL: one uint64 per seed from default_rng(seed + offset) over the full range, split high/low.
    values = np.random.default_rng(7 + 3).integers(0, 2**64 - 1, endpoint=True, dtype=np.uint64, size=6)
    expected = np.array([[int(v) >> 32, int(v) & 0xFFFFFFFF] for v in values], np.uint32).reshape(3, 1, 2, 2)
    got = ipuxl.create_seeds(7, offset=3, batches_per_step=3, replicas=2)
    np.testing.assert_array_equal(got, expected.squeeze(1))
    assert got.dtype == np.uint32


@pytest.mark.parametrize("shape", [(40, 1), (1, 60), (60,)])
def test_shaped_dropout_mask_is_shared_along_broadcast_axes(shape):
    x = randn((40, 60)) + 3.0  # away from 0, so a dropped element is recognisable

    def build(ir, load):
        return {"y": ops.shaped_dropout(load("x"), load("s"), shape, 0.5)}

    y = run_main(build, {"x": x, "s": _seed(3)})["y"]
    keep = y != 0
    np.testing.assert_allclose(y[keep], 2 * x[keep])
    expanded = np.broadcast_to(keep[tuple(slice(0, 1) if d == 1 else slice(None)
                                          for d in (1,) * (2 - len(shape)) + shape)], keep.shape)
    np.testing.assert_array_equal(keep, expanded)
    assert 0 < keep.mean() < 1


def test_shaped_dropout_gradient_reuses_the_mask():
    x, seed = randn((4, 6)) + 3.0, _seed(5)
    got = run_op(lambda t, s: ops.shaped_dropout(t, s, [4, 1], 0.5), [x, seed], grad_inputs=[0])
    (y,), (_, dy) = got["out"], got["dy"][0]
    np.testing.assert_allclose(got["grad"][0], dy * y / x)


def test_shaped_dropout_checks_the_mask_shape():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((4, 6), np.float32), name="x")
        s = ipuxl.variable(_seed(1), name="s")
        with pytest.raises(ValueError, match="does not broadcast"):
            ops.shaped_dropout(x, s, [3, 1], 0.5)
