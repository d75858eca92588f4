"""The in-place variable updates (``ipuxl.ops.var_updates``) and optimiser updaters, against eager
PyTorch and the formulas of PopXL's documentation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import InvalidArgumentError

from ._harness import randn, run_main

vu = ops.var_updates


def _factor(f, load):
    """A factor given as a number, or ``("tensor", value)``: a host-loaded float64 scalar."""
    return load("f") if isinstance(f, tuple) else f


def _fval(f):
    return f[1] if isinstance(f, tuple) else f


def _f32(f: float) -> float:
    return float(np.float32(f))


VAR_UPDATES = [
    ("accumulate_", lambda t, x, f: vu.accumulate_(t, x), lambda t, x, f: t + x, None),
    ("accumulate_", lambda t, x, f: vu.accumulate_(t, x, f), lambda t, x, f: t + f * x, 0.3),
    ("accumulate_", lambda t, x, f: vu.accumulate_(t, x, f), lambda t, x, f: t + f * x, ("tensor", -0.7)),
    ("accumulate_square_", lambda t, x, f: vu.accumulate_square_(t, x), lambda t, x, f: t + x * x, None),
    ("accumulate_square_", vu.accumulate_square_, lambda t, x, f: t + f * x * x, 0.3),
    ("accumulate_square_", vu.accumulate_square_, lambda t, x, f: t + f * x * x, ("tensor", 2.5)),
    ("accumulate_mean_", vu.accumulate_mean_, lambda t, x, f: t * f / (f + 1) + x / (f + 1), 3),
    ("accumulate_mean_", vu.accumulate_mean_, lambda t, x, f: t * f / (f + 1) + x / (f + 1), 0.0),
    ("accumulate_mean_", vu.accumulate_mean_, lambda t, x, f: t * f / (f + 1) + x / (f + 1), ("tensor", 2.0)),
    # Number factors are float32 in PopART, but these variables are float64, which no IPU has:
    # the factor is kept whole, as eager PyTorch applies a Python number to float64 tensors.
    ("accumulate_moving_average_", vu.accumulate_moving_average_,
     lambda t, x, f: f * t + (1 - f) * x, 0.9),
    ("accumulate_moving_average_", vu.accumulate_moving_average_, lambda t, x, f: f * t + (1 - f) * x,
     ("tensor", 0.8)),
    ("accumulate_moving_average_square_", vu.accumulate_moving_average_square_,
     lambda t, x, f: f * t + (1 - f) * x * x, 0.99),
    ("accumulate_moving_average_square_", vu.accumulate_moving_average_square_,
     lambda t, x, f: f * t + (1 - f) * x * x, ("tensor", 0.7)),
    ("accumulator_scale_", lambda t, x, f: vu.accumulator_scale_(t, f), lambda t, x, f: f * t, 0.5),
    ("accumulator_scale_", lambda t, x, f: vu.accumulator_scale_(t, f), lambda t, x, f: f * t, ("tensor", -2.0)),
    ("accumulator_scale_", lambda t, x, f: vu.accumulator_scale_(t, f), lambda t, x, f: 0 * t, 0.0),
    ("accumulator_zero_", lambda t, x, f: vu.accumulator_zero_(t), lambda t, x, f: 0 * t, None),
    ("copy_var_update_", lambda t, x, f: vu.copy_var_update_(t, x), lambda t, x, f: x, None),
]


@pytest.mark.parametrize("op", [vu.accumulate_moving_average_, vu.accumulate_moving_average_square_])
def test_a_moving_average_factor_is_float32_for_float32_variables(op):
    """PopART stores a number factor as float32: ``1 - f`` is ``1 - float32(0.999)`` (1.3e-5
    off 0.001, seen on t = 0, x = 1000; for x**2, on x = sqrt(1000))."""
    x = np.full((2,), 1000.0 if op is vu.accumulate_moving_average_ else 1000.0 ** 0.5, np.float32)

    def build(ir, load):
        t = ipuxl.variable(np.zeros(2, np.float32), ipuxl.float32, name="t")
        op(t, load("x"), 0.999)
        return {"t": t}

    got = run_main(build, {"x": x})["t"]
    expected = np.float32(1 - _f32(0.999)) * np.float32(1000.0)
    np.testing.assert_allclose(got, np.full(2, expected), rtol=1e-6)
    assert abs(got[0] - 1.0) > 1e-5  # not the whole factor's 0.001 * 1000


@pytest.mark.parametrize("name, build_fn, ref, f", [pytest.param(*v, id=f"{v[0]}-{v[3]}") for v in VAR_UPDATES])
def test_var_update(name, build_fn, ref, f):
    t0, x0 = randn((3, 4)), randn((3, 4), seed=1)

    def build(ir, load):
        t = ipuxl.variable(t0, ipuxl.float64, name="t")
        out = build_fn(t, load("x"), _factor(f, load))
        assert out.shape == t.shape
        return {"t": t, "out": out}

    inputs = {"x": x0}
    if isinstance(f, tuple):
        inputs["f"] = np.array(f[1], np.float64)
    got = run_main(build, inputs)
    expected = ref(t0, x0, _fval(f))
    np.testing.assert_allclose(got["t"], expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got["out"], expected, rtol=1e-12, atol=1e-12)  # returns the updated t


def test_accumulator_zero_clears_non_finite_values():
    t0 = np.array([1.0, np.nan, np.inf, -np.inf], np.float32)

    def build(ir, load):
        t = ipuxl.variable(t0, name="t")
        vu.accumulator_zero_(t)
        return {"t": t}

    got = run_main(build)
    np.testing.assert_array_equal(got["t"], np.zeros(4, np.float32))


def test_var_update_converts_the_update_dtype():
    t0, x0 = randn((3, 4), np.float32), randn((3, 4), np.float16, seed=1)

    def build(ir, load):
        t = ipuxl.variable(t0, name="t")
        vu.accumulate_(t, load("x"), 2.0)
        return {"t": t}

    got = run_main(build, {"x": x0})
    assert got["t"].dtype == np.float32
    np.testing.assert_allclose(got["t"], t0 + 2.0 * x0.astype(np.float32), rtol=1e-6)


@pytest.mark.parametrize("name, ref", [
    ("accumulate_", lambda t, x, f: t + f * x),
    ("accumulate_square_", lambda t, x, f: t + f * x * x),
    ("accumulate_mean_", lambda t, x, f: t * f / (f + 1) + x / (f + 1)),
    ("accumulate_moving_average_", lambda t, x, f: f * t + (1 - f) * x),
    ("accumulate_moving_average_square_", lambda t, x, f: f * t + (1 - f) * x * x),
    ("sparse_accumulate_", lambda t, x, f: t + f * x),
])
@pytest.mark.parametrize("factor", ["number", "float64-tensor"])
def test_var_update_other_dtypes(name, ref, factor):
    """``X`` (float16) and a tensor factor (float64) are converted to ``t``'s dtype (float32)."""
    t0, x0, f = randn((3, 4), np.float32), randn((3, 4), np.float16, seed=1), 0.75

    def build(ir, load):
        t = ipuxl.variable(t0, name="t")
        ff = load("f") if factor != "number" else f
        if name == "sparse_accumulate_":
            vu.sparse_accumulate_(t, load("x"), ipuxl.constant(np.arange(3, dtype=np.int32)), f=ff)
        else:
            getattr(vu, name)(t, load("x"), ff)
        return {"t": t}

    got = run_main(build, {"x": x0, "f": np.array(f)} if factor != "number" else {"x": x0})
    assert got["t"].dtype == np.float32
    np.testing.assert_allclose(got["t"], ref(t0, x0.astype(np.float32), f), rtol=1e-5, atol=1e-6)


def test_var_updates_apply_in_program_order():
    t0, x0 = randn((4,)), randn((4,), seed=1)

    def build(ir, load):
        t = ipuxl.variable(t0, ipuxl.float64, name="t")
        x = load("x")
        vu.accumulate_(t, x)
        snapshot = ops.identity(t)
        vu.accumulator_scale_(t, 3.0)
        vu.accumulate_square_(t, x, 0.5)
        return {"t": t, "snapshot": snapshot}

    got = run_main(build, {"x": x0})
    np.testing.assert_allclose(got["snapshot"], t0 + x0)
    np.testing.assert_allclose(got["t"], 3.0 * (t0 + x0) + 0.5 * x0 ** 2)


@pytest.mark.parametrize("axis, f, indices", [
    (0, None, [4, 1]), (0, 0.5, [4, 1]), (0, ("tensor", -2.0), [3, 3]), (1, None, [0, 4]), (1, 0.25, [2, 2]),
])
def test_sparse_accumulate_(axis, f, indices):
    t0 = randn((5, 5))
    x0 = randn((2, 5) if axis == 0 else (5, 2), seed=1)
    idx = np.array(indices, np.int32)

    def build(ir, load):
        t = ipuxl.variable(t0, ipuxl.float64, name="t")
        vu.sparse_accumulate_(t, load("x"), load("i"), axis=axis, f=_factor(f, load))
        return {"t": t}

    inputs = {"x": x0, "i": idx}
    if isinstance(f, tuple):
        inputs["f"] = np.array(f[1], np.float64)
    got = run_main(build, inputs)
    expected = t0.copy()
    scale = 1.0 if f is None else _fval(f)
    for k, i in enumerate(indices):  # repeated indices accumulate
        if axis == 0:
            expected[i] += scale * x0[k]
        else:
            expected[:, i] += scale * x0[:, k]
    np.testing.assert_allclose(got["t"], expected, rtol=1e-12)


_m, _v, _w = randn((3, 4), np.float32), randn((3, 4), np.float32, seed=1, low=0.1, high=2.0), randn(
    (3, 4), np.float32, seed=2)


@pytest.mark.parametrize("kwargs, expected", [
    ({}, _m / (np.sqrt(_v) + 1e-7)),
    ({"epsilon": 0.1}, _m / (np.sqrt(_v) + 0.1)),
    ({"weight": True, "weight_decay": 0.01}, _m / (np.sqrt(_v) + 1e-7) + 0.01 * _w),
    ({"weight": True, "weight_decay": ("tensor", 0.2)}, _m / (np.sqrt(_v) + 1e-7) + 0.2 * _w),
    ({"weight": True, "weight_decay": 0.0}, _m / (np.sqrt(_v) + 1e-7)),
], ids=["plain", "epsilon", "weight_decay", "weight_decay-tensor", "weight_decay-0"])
@pytest.mark.parametrize("updater", [vu.adam_updater, vu.lamb_updater], ids=["adam", "lamb"])
def test_adam_updater_without_bias_correction(updater, kwargs, expected):
    def build(ir, load):
        kw = dict(kwargs)
        if kw.get("weight"):
            kw["weight"] = ipuxl.variable(_w, name="w")
        if isinstance(kw.get("weight_decay"), tuple):
            kw["weight_decay"] = load("wd")
        return {"u": updater(load("m"), load("v"), **kw)}

    inputs = {"m": _m, "v": _v}
    if isinstance(kwargs.get("weight_decay"), tuple):
        inputs["wd"] = np.array(kwargs["weight_decay"][1], np.float32)
    got = run_main(build, inputs)
    assert got["u"].dtype == np.float32
    np.testing.assert_allclose(got["u"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("betas_as_tensors", [False, True])
def test_adam_updater_bias_correction_increments_time_step(betas_as_tensors):
    b1, b2, eps, wd, runs = 0.9, 0.999, 1e-6, 0.05, 3
    ir = ipuxl.Ir()
    with ir.main_graph:
        m = ops.host_load(m_s := ipuxl.h2d_stream(_m.shape, ipuxl.float32, "m"))
        v = ops.host_load(v_s := ipuxl.h2d_stream(_v.shape, ipuxl.float32, "v"))
        w = ipuxl.variable(_w, name="w")
        step = ipuxl.variable(np.array(0.0, np.float32), name="step")
        beta1 = ipuxl.constant(b1, ipuxl.float32) if betas_as_tensors else b1
        beta2 = ipuxl.constant(b2, ipuxl.float32) if betas_as_tensors else b2
        u = vu.adam_updater(m, v, w, step, wd, beta1, beta2, eps)
        ops.host_store(u_s := ipuxl.d2h_stream(u.shape, u.dtype, "u"), u)
    with ipuxl.Session(ir, "cpu") as session:
        outs = [session.run({m_s: _m, v_s: _v})[u_s] for _ in range(runs)]
        final_step = session.get_tensor_data(step)
    assert float(final_step) == runs
    for t, out in enumerate(outs, start=1):
        m_hat = _m.astype(np.float64) / (1 - b1 ** t)
        v_hat = _v.astype(np.float64) / (1 - b2 ** t)
        np.testing.assert_allclose(out, m_hat / (np.sqrt(v_hat) + eps) + wd * _w, rtol=1e-5, atol=1e-6,
                                   err_msg=f"step {t}")


def test_adam_updater_argument_errors():
    ir = ipuxl.Ir()
    with ir.main_graph:
        m, v = ipuxl.variable(_m), ipuxl.variable(_v)
        step = ipuxl.variable(np.array(0.0, np.float32))
        with pytest.raises(ValueError, match="beta1 and beta2"):
            vu.adam_updater(m, v, time_step=step, beta1=0.9)
        with pytest.raises(ValueError, match="weight decay requires"):
            vu.adam_updater(m, v, weight_decay=0.1)


@pytest.mark.parametrize("case_", ["normal", "lr-tensor", "max_weight_norm", "zero-weight", "zero-update"])
def test_adam_var_update(case_):
    w0 = np.zeros((3, 4), np.float32) if case_ == "zero-weight" else randn((3, 4), np.float32)
    x0 = np.zeros((3, 4), np.float32) if case_ == "zero-update" else randn((3, 4), np.float32, seed=1) * 0.3
    lr, mwn = 0.1, 0.5

    def build(ir, load):
        w = ipuxl.variable(w0, name="w")
        x = load("x")
        r1, r2 = vu.lamb_square(w), vu.lamb_square(x)
        lr_t = load("lr") if case_ == "lr-tensor" else lr
        out = vu.adam_var_update(w, x, r1, r2, lr_t, mwn if case_ == "max_weight_norm" else None)
        return {"w": w, "out": out, "r1": r1}

    inputs = {"x": x0}
    if case_ == "lr-tensor":
        inputs["lr"] = np.array(lr, np.float32)
    got = run_main(build, inputs)
    norm_w, norm_x = np.sqrt((w0.astype(np.float64) ** 2).sum()), np.sqrt((x0.astype(np.float64) ** 2).sum())
    np.testing.assert_allclose(got["r1"], norm_w ** 2, rtol=1e-5)
    if case_ == "max_weight_norm":
        assert norm_w > mwn
        norm_w = mwn
    ratio = 1.0 if norm_w == 0 or norm_x == 0 else norm_w / norm_x
    expected = w0 - lr * ratio * x0
    np.testing.assert_allclose(got["w"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["out"], expected, rtol=1e-5, atol=1e-6)


def test_adam_var_update_needs_a_learning_rate():
    ir = ipuxl.Ir()
    with ir.main_graph, pytest.raises(InvalidArgumentError, match="learning_rate"):
        w = ipuxl.variable(_w)
        vu.adam_var_update(w, w, vu.lamb_square(w), vu.lamb_square(w))


@pytest.mark.parametrize("wd, dtype", [(None, np.float32), (0.01, np.float32), (0.1, np.float16)])
def test_adamax_updater(wd, dtype):
    m0, u0, w0 = randn((3, 2), dtype), np.abs(randn((3, 2), dtype, seed=1)), randn((3, 2), dtype, seed=2)

    def build(ir, load):
        m, u, w = (ipuxl.variable(a, name=n) for a, n in ((m0, "m"), (u0, "u"), (w0, "w")))
        step = ipuxl.variable(np.array(2.0, np.float32), name="step")
        out = vu.adamax_updater(m, u, w, step, wd, beta1=0.8, epsilon=1e-6)
        return {"out": out, "step": step}

    got = run_main(build)
    m, u, w = (torch.from_numpy(a).float() for a in (m0, u0, w0))
    expected = m / (1 - 0.8 ** 3) / (u + 1e-6) + (w * wd if wd else 0)
    assert got["step"] == 3.0
    torch.testing.assert_close(torch.from_numpy(got["out"]), expected.to(torch.from_numpy(w0).dtype),
                               atol=1e-6 if dtype == np.float32 else 1e-3, rtol=1e-3)


def test_adamax_updater_needs_a_time_step():
    ir = ipuxl.Ir()
    with ir.main_graph:
        m = ipuxl.variable(np.zeros((2,), np.float32), name="m")
        with pytest.raises(ValueError, match="requires time_step"):
            vu.adamax_updater(m, m)
        with pytest.raises(ValueError, match="weight decay requires"):
            vu.adamax_updater(m, m, time_step=m, weight_decay=0.1)
