"""The element-wise ops (``ipuxl.ops.elementwise``), forward and gradient, against eager PyTorch:
unary, binary, logic and select, scaled add, in-place versions (which write their input), and
unsigned arithmetic wrapping as on the IPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops

from ._harness import bools, case, check_op, ints, pos, randn, run_case, run_main, run_op


UNARY = [
    case("negate", ops.negate, torch.neg, (3, 4)),
    case("abs", ops.abs, torch.abs, (3, 4)),
    case("exp", ops.exp, torch.exp, (3, 4)),
    case("log", ops.log, torch.log, pos((3, 4))),
    case("sqrt", ops.sqrt, torch.sqrt, pos((3, 4))),
    case("tanh", ops.tanh, torch.tanh, (3, 4)),
    case("sigmoid", ops.sigmoid, torch.sigmoid, (3, 4)),
    case("relu", ops.relu, torch.relu, (3, 4)),
    case("gelu_tanh", ops.gelu, lambda x: F.gelu(x, approximate="tanh"), (3, 4), atol=1e-12, rtol=1e-12),
    case("swish", ops.swish, F.silu, (3, 4)),
    case("sin", ops.sin, torch.sin, (3, 4)),
    case("cos", ops.cos, torch.cos, (3, 4)),
    case("ceil", ops.ceil, torch.ceil, randn((3, 4)) * 3),
    case("floor", ops.floor, torch.floor, randn((3, 4)) * 3),
    case("sign", ops.sign, torch.sign, (3, 4)),
    case("identity", ops.identity, torch.clone, (3, 4)),
    case("logical_not", ops.logical_not, torch.logical_not, bools((3, 4)), grad=False),
    case("isnan", ops.isnan, torch.isnan, np.array([1.0, np.nan, np.inf, -np.inf, 0.0]), grad=False),
    case("isinf", ops.isinf, torch.isinf, np.array([1.0, np.nan, np.inf, -np.inf, 0.0]), grad=False),
    case("float32", ops.tanh, torch.tanh, (3, 4), dtype=np.float32, atol=1e-6, rtol=1e-6),
]


def _twice(fn):
    """Apply an in-place op to a fresh copy (a graph input may not be written by reference)."""
    return lambda x: fn(ops.identity(x))


UNARY += [
    case("exp_", _twice(ops.exp_), torch.exp, (3, 4)),
    case("relu_", _twice(ops.relu_), torch.relu, (3, 4)),
    case("gelu_", _twice(ops.gelu_), lambda x: F.gelu(x, approximate="tanh"), (3, 4)),
    case("swish_", _twice(ops.swish_), F.silu, (3, 4)),
    case("geluerf", ops.geluerf, F.gelu, (3, 4)),
    case("geluerf_", _twice(ops.geluerf_), F.gelu, (3, 4)),
    case("log2", ops.log2, torch.log2, pos((3, 4))),
    case("isfinite", ops.isfinite, torch.isfinite, np.array([1.0, np.nan, np.inf, -np.inf, 0.0]), grad=False),
    case("clamp", lambda x: ops.clamp(x, -0.5, 0.5), lambda x: torch.clamp(x, -0.5, 0.5), (3, 4)),
    case("clip-default-bounds", ops.clip, torch.clone, (3, 4)),
    case("clip-min-only", lambda x: ops.clip(x, min=0.0), lambda x: torch.clamp(x, min=0.0), (3, 4)),
    case("increment_mod", lambda x: ops.increment_mod(x, 1.5, 2.0), lambda x: torch.fmod(x + 1.5, 2.0),
         randn((3, 4)) * 3),
    case("increment_mod-int", lambda x: ops.increment_mod(x, 1, 4), lambda x: torch.fmod(x + 1, 4),
         np.arange(8, dtype=np.int32), grad=False),
    case("increment_mod_", _twice(lambda x: ops.increment_mod_(x, 0.5, 1.0)), lambda x: torch.fmod(x + 0.5, 1.0),
         randn((3, 4)), grad=False),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", UNARY)
def test_unary(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def test_gelu_is_the_tanh_approximation():
    x = np.linspace(-3, 3, 13)
    out = run_op(ops.gelu, [x], grad=False)["out"][0]
    exact = F.gelu(torch.from_numpy(x)).numpy()
    assert np.abs(out - exact).max() > 1e-5, "ops.gelu matches erf-GELU, not the tanh approximation"


BINARY_FNS = [
    ("add", ops.add, torch.add),
    ("sub", ops.sub, torch.sub),
    ("mul", ops.mul, torch.mul),
    ("div", ops.div, torch.div),
    ("pow", ops.pow, torch.pow),
    ("fmod", ops.fmod, torch.fmod),
    ("maximum", ops.maximum, torch.maximum),
    ("minimum", ops.minimum, torch.minimum),
]


BINARY_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (2, 3))]


BINARY = [
    case(f"{name}-{'x'.join(map(str, a)) or 'scalar'}-{'x'.join(map(str, b))}", fn, ref,
         pos(a, 1) * 3 if name in ("pow", "fmod") else randn(a, seed=1),
         pos(b, 2) * (0.7 if name == "fmod" else 1))
    for name, fn, ref in BINARY_FNS for a, b in BINARY_SHAPES
]

BINARY += [
    case("fmod-negative", ops.fmod, torch.fmod, randn((3, 4), seed=3) * 5, pos((3, 4), 4) * 0.9),
    case("add-number", lambda x: ops.add(x, 2.5), lambda x: x + 2.5, (3, 4)),
    case("sub-number-lhs", lambda x: ops.sub(1.5, x), lambda x: 1.5 - x, (3, 4)),
    case("mul-number", lambda x: ops.mul(x, -3.0), lambda x: x * -3.0, (3, 4)),
    case("div-number-lhs", lambda x: ops.div(2.0, x), lambda x: 2.0 / x, pos((3, 4))),
    case("pow-number", lambda x: ops.pow(x, 3.0), lambda x: x ** 3.0, (3, 4)),
    case("maximum-3", lambda a, b, c: ops.maximum(a, b, c), lambda a, b, c: torch.maximum(torch.maximum(a, b), c),
         (3, 4), (4,), (3, 1)),
    case("minimum-3", lambda a, b, c: ops.minimum(a, b, c), lambda a, b, c: torch.minimum(torch.minimum(a, b), c),
         (3, 4), (4,), (3, 1)),
    case("div-int-truncates", ops.div, lambda a, b: torch.div(a, b, rounding_mode="trunc"),
         np.array([7, -7, 6, -6, 1], np.int32), np.array([2, 2, -4, 4, 3], np.int32), grad=False),
    case("div-int-number", lambda a: ops.div(a, 2), lambda a: torch.div(a, 2, rounding_mode="trunc"),
         np.array([7, -7, 6, -6, 1], np.int32), grad=False),
    case("div-number-int", lambda a: ops.div(-20, a), lambda a: torch.div(-20, a, rounding_mode="trunc"),
         np.array([7, -7, 6, -6, 1], np.int32), grad=False),
    case("div-int-operator", lambda a: a / 4, lambda a: torch.div(a, 4, rounding_mode="trunc"),
         np.array([7, -7, 6, -6, 1], np.int32), grad=False),
    case("div-int-float-number", lambda a: ops.div(a, 2.0), lambda a: a / 2.0, np.array([7, -7], np.int32),
         grad=False),
    case("add-int", ops.add, torch.add, ints((3, 4), -5, 5), ints((4,), -5, 5, seed=1), grad=False),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", BINARY)
def test_binary(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


_cmp_a = ints((3, 4), 0, 3)


_cmp_b = ints((4,), 0, 3, seed=1)


LOGIC = [
    case("equal-int", ops.equal, torch.eq, _cmp_a, _cmp_b, grad=False),
    case("equal-float", ops.equal, torch.eq, _cmp_a.astype(np.float64), _cmp_b.astype(np.float64), grad=False),
    case("greater-int", ops.greater, torch.gt, _cmp_a, _cmp_b, grad=False),
    case("greater-float", ops.greater, torch.gt, (3, 4), (3, 1), grad=False),
    case("less-int", ops.less, torch.lt, _cmp_a, _cmp_b, grad=False),
    case("less-float", ops.less, torch.lt, (3, 4), (4,), grad=False),
    case("greater-number", lambda x: ops.greater(x, 0.2), lambda x: x > 0.2, (3, 4), grad=False),
    case("logical_and", ops.logical_and, torch.logical_and, bools((3, 4)), bools((4,), 1), grad=False),
    case("logical_or", ops.logical_or, torch.logical_or, bools((3, 4)), bools((3, 1), 1), grad=False),
    case("where", ops.where, torch.where, bools((3, 4)), (3, 4), (3, 4)),
    case("where-broadcast", ops.where, torch.where, bools((3, 1)), (3, 4), (4,)),
    case("where-number", lambda c, x: ops.where(c, x, 0.0), lambda c, x: torch.where(c, x, 0.0),
         bools((3, 4)), (3, 4)),
    case("clip", lambda x: ops.clip(x, -0.5, 0.5), lambda x: torch.clamp(x, -0.5, 0.5), (4, 5)),
    case("clip-min", lambda x: ops.clip(x, min=0.1), lambda x: torch.clamp(x, min=0.1), (4, 5)),
    case("clip-no-bounds", ops.clip, torch.clone, (4, 5)),
    case("clip-max", lambda x: ops.clip(x, max=-0.1), lambda x: torch.clamp(x, max=-0.1), (4, 5)),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", LOGIC)
def test_logic_and_select(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


SCALED = [
    case("scaled_add", lambda x, y: ops.scaled_add(x, y, 0.5, -2.0), lambda x, y: 0.5 * x - 2.0 * y, (3, 4), (3, 4)),
    case("scaled_add-default", ops.scaled_add, torch.add, (3, 4), (4,)),
    case("scaled_add-tensors", lambda x, y, a, b: ops.scaled_add(x, y, a, b), lambda x, y, a, b: a * x + b * y,
         (3, 4), (3, 4), np.array(0.3), np.array(-1.5)),
    # In-place ops on a graph input: forward here, gradient in test_in_place_op_on_graph_input_gradient.
    case("scaled_add_", lambda x, y: ops.scaled_add_(x, y, 0.5, -2.0), lambda x, y: 0.5 * x - 2.0 * y,
         (3, 4), (3, 4), grad=False),
    case("scaled_add_-sgd", lambda x, y: ops.scaled_add_(x, y, b=-0.1), lambda x, y: x - 0.1 * y, (3, 4), (3, 4),
         grad=False),
    case("scaled_add_-tensors", lambda x, y, a, b: ops.scaled_add_(x, y, a, b), lambda x, y, a, b: a * x + b * y,
         (3, 4), (3, 4), np.array(0.3), np.array(-1.5), grad=False),
    case("add_", ops.add_, torch.add, (3, 4), (4,), grad=False),
    # In-place ops on an intermediate tensor: differentiable.
    case("scaled_add_-intermediate", lambda x, y: ops.scaled_add_(x * 1.0, y, 0.5, -2.0),
         lambda x, y: 0.5 * x - 2.0 * y, (3, 4), (3, 4)),
    case("scaled_add_-intermediate-tensors", lambda x, y, a, b: ops.scaled_add_(ops.identity(x), y, a, b),
         lambda x, y, a, b: a * x + b * y, (3, 4), (3, 4), np.array(0.3), np.array(-1.5)),
    case("add_-intermediate", lambda x, y: ops.add_(x * 2.0, y), lambda x, y: x * 2.0 + y, (3, 4), (4,)),
    case("operators", lambda x, y, w: (-(x + y) * 2.0 - 1.0) / (abs(y) + 1.0) @ w + x[0] ** 2,
         lambda x, y, w: (-(x + y) * 2.0 - 1.0) / (abs(y) + 1.0) @ w + x[0] ** 2, (3, 4), (3, 4), (4, 4)),
    case("operators-compare", lambda x, y: ((x < y) | (x >= 0.5)) & ~(y > 1.0),
         lambda x, y: ((x < y) | (x >= 0.5)) & ~(y > 1.0), (3, 4), (3, 4), grad=False),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", SCALED)
def test_scaled_add_and_operators(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


@pytest.mark.parametrize("fn, ref", [
    (lambda x, y: ops.scaled_add_(x, y, 0.5, -2.0), lambda x, y: 0.5 * x - 2.0 * y),
    (ops.add_, torch.add),
], ids=["scaled_add_", "add_"])
def test_in_place_op_on_graph_input_gradient(fn, ref):
    check_op(fn, ref, [(3, 4), (3, 4)])


def test_less_equal_operators_with_nan():
    x = np.array([np.nan, 1.0, 2.0, 1.5])
    check_op(lambda t: ops.logical_or(t <= 1.5, t >= 1.75), lambda t: (t <= 1.5) | (t >= 1.75), [x], grad=False)


def test_in_place_op_writes_its_input_in_main_graph():
    x0, y0 = randn((3, 4)), randn((3, 4), seed=1)

    def build(ir, load):
        x = ipuxl.variable(x0, ipuxl.float64, name="x")
        before = ops.identity(x)
        out = ops.scaled_add_(x, load("y"), 2.0, 0.5)
        return {"x": x, "before": before, "out": out}

    got = run_main(build, {"y": y0})
    np.testing.assert_allclose(got["before"], x0)
    np.testing.assert_allclose(got["x"], 2.0 * x0 + 0.5 * y0)
    np.testing.assert_allclose(got["out"], 2.0 * x0 + 0.5 * y0)


@pytest.mark.parametrize("op, ref", [
    (ops.exp_, torch.exp), (ops.relu_, torch.relu), (ops.gelu_, lambda x: F.gelu(x, approximate="tanh")),
    (ops.swish_, F.silu), (ops.geluerf_, F.gelu), (lambda x: ops.increment_mod_(x, 1.0, 3.0),
                                                   lambda x: torch.fmod(x + 1.0, 3.0)),
], ids=["exp_", "relu_", "gelu_", "swish_", "geluerf_", "increment_mod_"])
def test_unary_inplace_writes_the_variable(op, ref):
    x0 = randn((2, 3))

    def build(ir, load):
        x = ipuxl.variable(x0, ipuxl.float64, name="x")
        out = op(x)
        return {"x": x, "out": out}

    got = run_main(build)
    torch.testing.assert_close(torch.from_numpy(got["x"]), ref(torch.from_numpy(x0)))
    torch.testing.assert_close(torch.from_numpy(got["out"]), ref(torch.from_numpy(x0)))


def test_increment_mod_rejects_a_zero_modulus():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((2,), np.float32))
        with pytest.raises(ValueError, match="modulus"):
            ops.increment_mod(x, 1.0, 0.0)


def test_unary_inplace_refuses_constants():
    ir = ipuxl.Ir()
    with ir.main_graph:
        c = ipuxl.constant(np.zeros((2,), np.float32), name="c")
        with pytest.raises(TypeError, match="ops.exp "):
            ops.exp_(c)


def test_unsigned_arithmetic_wraps_on_cpu():
    a = np.array([1, 2**32 - 1, 7], np.uint32)
    b = np.array([2, 3, 5], np.uint32)

    def build(ir, load):
        x, y = load("a"), load("b")
        counter = ipuxl.variable(np.array([4294967295, 3], np.uint32), name="counter")
        ops.add_(counter, ipuxl.constant(np.array([1, 1], np.uint32)))
        return {"add": x + y, "sub": ops.sub(x, y), "fmod": ops.fmod(x, y), "inc": ops.increment_mod(x, 1, 5),
                "counter": counter}

    got = run_main(build, {"a": a, "b": b})
    wide = a.astype(np.int64), b.astype(np.int64)
    np.testing.assert_array_equal(got["add"], ((wide[0] + wide[1]) % 2**32).astype(np.uint32))
    np.testing.assert_array_equal(got["sub"], ((wide[0] - wide[1]) % 2**32).astype(np.uint32))
    np.testing.assert_array_equal(got["fmod"], (wide[0] % wide[1]).astype(np.uint32))
    np.testing.assert_array_equal(got["inc"], ((wide[0] + 1) % 2**32 % 5).astype(np.uint32))
    np.testing.assert_array_equal(got["counter"], np.array([0, 4], np.uint32))
    assert all(v.dtype == np.uint32 for v in got.values())
