"""Every op of ``ipuxl.ops``, forward and gradient, against eager PyTorch.

Each op is built in a subgraph, called from the main graph on host-loaded data and
run in a ``Session`` (see ``_harness.check_op``); gradients come from
``transforms.autodiff`` of that subgraph. Oracles are eager PyTorch, or formulas
written here from the ops' documented semantics (PopXL's).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import InvalidArgumentError, ShapeMismatchError

from ._harness import check_op, randn, run_main, run_op

vu = ops.var_updates


def case(id_: str, ipuxl_fn, torch_fn, *inputs, marks=(), **kwargs):
    """One ``check_op`` case for ``pytest.mark.parametrize``."""
    return pytest.param(ipuxl_fn, torch_fn, list(inputs), kwargs, id=id_, marks=marks)


def ints(shape, low=0, high=3, dtype=np.int32, seed=0):
    return np.random.default_rng(seed).integers(low, high, size=shape).astype(dtype)


def bools(shape, seed=0):
    return np.random.default_rng(seed).random(shape) > 0.5


def pos(shape, seed=0):
    """Positive data away from zero (log, sqrt, pow, divisors)."""
    return randn(shape, seed=seed, low=0.5, high=2.0)


def run_case(ipuxl_fn, torch_fn, inputs, kwargs):
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


# -- element-wise ----------------------------------------------------------------------------------
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


# -- matmul and nn -----------------------------------------------------------------------------------
MATMUL = [
    case("2d", ops.matmul, torch.matmul, (3, 4), (4, 5)),
    case("batched", ops.matmul, torch.matmul, (2, 3, 4), (2, 4, 5)),
    case("batched-rhs-2d", ops.matmul, torch.matmul, (2, 3, 4), (4, 5)),
    case("broadcast", ops.matmul, torch.matmul, (2, 1, 3, 4), (5, 4, 2)),
    case("vec-mat", ops.matmul, torch.matmul, (4,), (4, 3)),
    case("mat-vec", ops.matmul, torch.matmul, (3, 4), (4,)),
    case("output_type", lambda a, b: ops.matmul(a, b, output_type=ipuxl.float32),
         lambda a, b: (a @ b).float(), (3, 4), (4, 5), atol=1e-6, rtol=1e-6),
    case("operator", lambda a, b: a @ b, torch.matmul, (3, 4), (4, 2)),
    case("grad-rhs-only", ops.matmul, torch.matmul, (3, 4), (4, 2), grad_inputs=[1]),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", MATMUL)
def test_matmul(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def _layer_norm_ref(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


NN = [
    case("softmax-last", lambda x: ops.softmax(x, -1), lambda x: torch.softmax(x, -1), (3, 5)),
    case("softmax-0", lambda x: ops.softmax(x, 0), lambda x: torch.softmax(x, 0), (3, 5)),
    case("softmax-3d", lambda x: ops.softmax(x, 1), lambda x: torch.softmax(x, 1), (2, 3, 4)),
    case("log_softmax-last", lambda x: ops.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1), (3, 5)),
    case("log_softmax-0", lambda x: ops.log_softmax(x, 0), lambda x: torch.log_softmax(x, 0), (2, 3, 4)),
    case("layer_norm", ops.layer_norm, _layer_norm_ref, (4, 6), (6,), (6,)),
    case("layer_norm-3d-eps", lambda x, w, b: ops.layer_norm(x, w, b, epsilon=1e-2),
         lambda x, w, b: _layer_norm_ref(x, w, b, 1e-2), (2, 3, 5), (5,), (5,)),
    case("conv", ops.conv, F.conv2d, (2, 3, 6, 6), (4, 3, 3, 3)),
    case("conv-stride-pad-dilation", lambda x, w: ops.conv(x, w, (2, 1), (1, 2, 1, 2), (1, 2)),
         lambda x, w: F.conv2d(x, w, None, (2, 1), (1, 2), (1, 2)), (2, 3, 7, 8), (4, 3, 3, 3)),
    case("conv-groups", lambda x, w: ops.conv(x, w, groups=2), lambda x, w: F.conv2d(x, w, groups=2),
         (1, 4, 5, 5), (6, 2, 2, 2)),
    case("max_pool", lambda x: ops.max_pool(x, (2, 2)), lambda x: F.max_pool2d(x, (2, 2), 1), (2, 3, 6, 6)),
    case("max_pool-stride", lambda x: ops.max_pool(x, (3, 2), (1, 2)),
         lambda x: F.max_pool2d(x, (3, 2), (1, 2)), (1, 2, 6, 6)),
    case("average_pool", lambda x: ops.average_pool(x, (2, 2)), lambda x: F.avg_pool2d(x, (2, 2), 1),
         (2, 3, 6, 6)),
    case("average_pool-stride", lambda x: ops.average_pool(x, (3, 3), (2, 1)),
         lambda x: F.avg_pool2d(x, (3, 3), (2, 1)), (1, 2, 7, 6)),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", NN)
def test_nn(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def _nll_ref(probs, labels, ignore_index=None, reduction="mean", log_prob=False):
    """PopXL's NLL from the documented formula: ``-log(max(p, 1e-7))`` of the label's probability.

    Ignored labels contribute 0 and, for ``"mean"``, are not counted.
    """
    classes = probs.shape[-1]
    logp = probs if log_prob else torch.log(torch.clamp(probs, min=1e-7))
    flat = F.nll_loss(logp.reshape(-1, classes), labels.reshape(-1).long(),
                      ignore_index=-100 if ignore_index is None else ignore_index, reduction=reduction)
    return flat.reshape(labels.shape) if reduction == "none" else flat


def _probs(shape, seed=0, zero_at=None):
    p = np.random.default_rng(seed).random(shape) + 0.05
    p /= p.sum(-1, keepdims=True)
    if zero_at is not None:
        p[zero_at] = 0.0  # clamped to 1e-7 in the loss, no gradient
    return p


_labels = np.array([0, 2, 1, 2, 3], np.int32)
NLL = [
    case(f"{reduction}{'-ignore' if ignore is not None else ''}",
         lambda p, l, r=reduction, i=ignore: ops.nll_loss(p, l, ignore_index=i, reduction=r),
         lambda p, l, r=reduction, i=ignore: _nll_ref(p, l, i, r),
         _probs((5, 4), zero_at=(0, 0)), _labels)
    for reduction in ("mean", "sum", "none") for ignore in (None, 2)
]
NLL += [
    case("mean-3d-labels", lambda p, l: ops.nll_loss(p, l), lambda p, l: _nll_ref(p, l),
         _probs((2, 3, 4), 1), ints((2, 3), 0, 4)),
    case("none-3d-labels-ignore", lambda p, l: ops.nll_loss(p, l, ignore_index=1, reduction="none"),
         lambda p, l: _nll_ref(p, l, 1, "none"), _probs((2, 3, 4), 2), ints((2, 3), 0, 4, seed=3)),
    case("log_prob", lambda p, l: ops.nll_loss(p, l, log_prob=True), lambda p, l: _nll_ref(p, l, log_prob=True),
         np.log(_probs((5, 4), 3)), _labels),
    case("log_prob-ignored-minus-inf", lambda p, l: ops.nll_loss(p, l, 1, "mean", log_prob=True),
         lambda p, l: _nll_ref(p, l, 1, "mean", log_prob=True), np.array([[-np.inf, -0.1], [-1.0, -0.5]]),
         np.array([1, 0], np.int32)),
    case("log_prob-sum-ignore", lambda p, l: ops.nll_loss(p, l, 3, "sum", log_prob=True),
         lambda p, l: _nll_ref(p, l, 3, "sum", log_prob=True), np.log(_probs((5, 4), 4)), _labels),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", NLL)
def test_nll_loss(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def _nll_softmax_ref(x, labels, loss_grad=1.0, ignore_index=None, reduction="mean"):
    """Loss of ``softmax(x)`` and the autograd gradient of ``loss_grad * loss`` w.r.t. ``x``."""
    x = x.detach().requires_grad_(True)
    loss = _nll_ref(torch.softmax(x, -1), labels, ignore_index, reduction)
    (dx,) = torch.autograd.grad(loss, x, torch.ones_like(loss) * loss_grad)
    return loss.detach(), dx


NLL_SOFTMAX = [
    case(f"{reduction}{'-ignore' if ignore is not None else ''}-lossgrad{lg}",
         lambda x, l, r=reduction, i=ignore, lg=lg: ops.nll_loss_with_softmax_grad(
             ops.softmax(x, -1), l, loss_grad=lg, ignore_index=i, reduction=r),
         lambda x, l, r=reduction, i=ignore, lg=lg: _nll_softmax_ref(x, l, lg, i, r),
         randn((5, 4), seed=7), _labels, grad=False)
    for reduction in ("mean", "sum", "none") for ignore in (None, 2) for lg in (1, 0.25)
]
NLL_SOFTMAX += [
    case("mean-3d", lambda x, l: ops.nll_loss_with_softmax_grad(ops.softmax(x, -1), l),
         lambda x, l: _nll_softmax_ref(x, l), randn((2, 3, 4), seed=8), ints((2, 3), 0, 4), grad=False),
    case("loss_grad-tensor", lambda x, l, g: ops.nll_loss_with_softmax_grad(ops.softmax(x, -1), l, g),
         lambda x, l, g: _nll_softmax_ref(x, l, g), randn((5, 4), seed=9), _labels, np.array(0.5), grad=False),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", NLL_SOFTMAX)
def test_nll_loss_with_softmax_grad(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def test_nll_loss_rejects_unknown_reduction():
    ir = ipuxl.Ir()
    with ir.main_graph, pytest.raises(InvalidArgumentError, match="reduction"):
        p = ipuxl.variable(np.ones((2, 3), np.float32))
        ops.nll_loss(p, ipuxl.variable(np.zeros((2,), np.int32)), reduction="avg")


# -- reductions ----------------------------------------------------------------------------------------
def _dims(x, axis):
    return list(range(x.dim())) if axis is None else [axis] if isinstance(axis, int) else list(axis)


def _prod_ref(x, dims, keepdim):
    for d in sorted((d % x.dim() for d in dims), reverse=True):
        x = torch.prod(x, d, keepdim=keepdim)
    return x


REDUCE_FNS = [
    ("sum", ops.sum, lambda x, d, k: torch.sum(x, d, k)),
    ("mean", ops.mean, lambda x, d, k: torch.mean(x, d, k)),
    ("max", ops.max, lambda x, d, k: torch.amax(x, d, k)),
    ("min", ops.min, lambda x, d, k: torch.amin(x, d, k)),
    ("prod", ops.prod, _prod_ref),
    ("sumsquare", ops.sumsquare, lambda x, d, k: torch.sum(x * x, d, k)),
    ("logsumexp", ops.logsumexp, lambda x, d, k: torch.logsumexp(x, d, k)),
    ("l1", ops.l1, lambda x, d, k: torch.sum(torch.abs(x), d, k)),
    ("l2", ops.l2, lambda x, d, k: torch.sqrt(torch.sum(x * x, d, k))),
]
REDUCE = [
    case(f"{name}-axis{axis}-keep{keep}", lambda x, f=fn, a=axis, k=keep: f(x, a, k),
         lambda x, r=ref, a=axis, k=keep: r(x, _dims(x, a), k), (2, 3, 4))
    for name, fn, ref in REDUCE_FNS for axis in (None, 1, -1, [0, 2], [1, -3]) for keep in (False, True)
]
REDUCE += [
    case(f"{alias}-axis{axis}", lambda x, f=getattr(ops, alias), a=axis: f(x, axis=a, keepdims=True),
         lambda x, r=ref, a=axis: r(x, _dims(x, a), True), (2, 3, 4))
    for alias, ref in [("reduce_sum", torch.sum), ("reduce_mean", torch.mean), ("reduce_max", torch.amax),
                       ("reduce_min", torch.amin)]
    for axis in (None, [1, 2])
]
REDUCE += [
    case(f"{name}-dim{dim}-keep{keep}", lambda x, f=fn, d=dim, k=keep: f(x, d, k),
         lambda x, r=ref, d=dim, k=keep: r(x, d, k).to(torch.int32), (3, 4, 5), grad=False)
    for name, fn, ref in [("argmax", ops.argmax, torch.argmax), ("argmin", ops.argmin, torch.argmin)]
    for dim in (0, 1, -1) for keep in (False, True)
]
REDUCE += [
    case("argmax-default", ops.argmax, lambda x: torch.argmax(x, 0).to(torch.int32), (4, 3), grad=False),
    case("lamb_square", ops.lamb_square, lambda x: torch.sum(x.float() * x.float()), (3, 4),
         atol=1e-5, rtol=1e-5),
    case("lamb_square-fp16", ops.lamb_square, lambda x: torch.sum(x.float() ** 2), (3, 4),
         dtype=np.float16, grad=False, atol=1e-5, rtol=1e-5),
    case("lamb_square-var_updates", vu.lamb_square, lambda x: torch.sum(x.float() ** 2), (5,),
         dtype=np.float32, atol=1e-5, rtol=1e-5),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", REDUCE)
def test_reduce(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def test_reduce_aliases():
    assert (ops.reduce_sum, ops.reduce_mean, ops.reduce_max, ops.reduce_min) == (ops.sum, ops.mean, ops.max, ops.min)


# -- shape ops --------------------------------------------------------------------------------------------
def _py_slice(x, key):
    """Reference for slices with any step: index_select with Python's own slice of range()."""
    for axis, k in enumerate(key):
        idx = list(range(x.shape[axis]))[k]
        x = torch.index_select(x, axis, torch.tensor(idx, dtype=torch.long))
    return x


def _take(x, idx, axis):
    return x[(slice(None),) * axis + (idx.long(),)]


def _unsqueeze_ref(x, axes):
    """ONNX/PopXL Unsqueeze: ``axes`` index the output, negatives counted from its back."""
    axes = [axes] if isinstance(axes, int) else list(axes)
    rank = x.dim() + len(axes)
    for a in sorted(a % rank for a in axes):
        x = x.unsqueeze(a)
    return x


_gidx = np.array([[2, 0], [4, 4]], np.int32)
_oor = np.array([[2, -1], [5, 7]], np.int32)
_slice_x = randn((4, 5))
SHAPE = [
    case("reshape", lambda x: ops.reshape(x, (6, 4)), lambda x: x.reshape(6, 4), (2, 3, 4)),
    case("reshape-minus1", lambda x: ops.reshape(x, (-1, 2)), lambda x: x.reshape(-1, 2), (2, 3, 4)),
    case("reshape-method", lambda x: x.reshape((4, 6)), lambda x: x.reshape(4, 6), (2, 3, 4)),
    case("flatten", ops.flatten, torch.flatten, (2, 3, 4)),
    case("flatten-method", lambda x: x.flatten(), torch.flatten, (2, 3)),
    case("transpose-default", ops.transpose, lambda x: x.permute(2, 1, 0), (2, 3, 4)),
    case("transpose-perm", lambda x: ops.transpose(x, (1, 0, 2)), lambda x: x.permute(1, 0, 2), (2, 3, 4)),
    case("transpose-T", lambda x: x.T, lambda x: x.t(), (2, 3)),
    case("concat-0", lambda a, b: ops.concat([a, b]), lambda a, b: torch.cat([a, b]), (2, 3), (4, 3)),
    case("concat-1", lambda a, b, c: ops.concat((a, b, c), axis=1), lambda a, b, c: torch.cat([a, b, c], 1),
         (2, 3), (2, 1), (2, 2)),
    case("concat-neg", lambda a, b: ops.concat([a, b], axis=-1), lambda a, b: torch.cat([a, b], -1),
         (2, 2, 3), (2, 2, 1)),
    case("split-equal", lambda x: ops.split(x, 2), lambda x: torch.split(x, 2), (4, 3)),
    case("split-sizes", lambda x: ops.split(x, [1, 3, 1], axis=1), lambda x: torch.split(x, [1, 3, 1], 1), (2, 5)),
    case("slice-1axis", lambda x: ops.slice(x, 1, 3, axis=0), lambda x: x[1:3], _slice_x),
    case("slice-lists", lambda x: ops.slice(x, [0, 1], [3, 5], [1, 2], [0, 1]), lambda x: x[0:3, 1:5:2], _slice_x),
    case("slice-axis-none", lambda x: ops.slice(x, [1], [4]), lambda x: x[1:4], _slice_x),
    case("slice-negative-index", lambda x: ops.slice(x, -3, -1, axis=1), lambda x: x[:, -3:-1], _slice_x),
    case("slice-negative-step", lambda x: ops.slice(x, [3], [0], [-1], [1]),
         lambda x: _py_slice(x, [slice(None), slice(3, 0, -1)]), _slice_x),
    case("slice-negative-step-2", lambda x: ops.slice(x, [-1, 4], [-5, 0], [-2, -1], [0, 1]),
         lambda x: _py_slice(x, [slice(-1, -5, -2), slice(4, 0, -1)]), _slice_x),
    case("slice-mixed-steps", lambda x: ops.slice(x, [0, None], [3, None], [2, -1], [0, 1]),
         lambda x: _py_slice(x, [slice(0, 3, 2), slice(None, None, -1)]), _slice_x),
    case("squeeze-all", ops.squeeze, torch.squeeze, (1, 3, 1, 2)),
    case("squeeze-axes", lambda x: ops.squeeze(x, [0]), lambda x: x.squeeze(0), (1, 3, 1, 2)),
    case("squeeze-negative", lambda x: ops.squeeze(x, [-2]), lambda x: x.squeeze(-2), (1, 3, 1, 2)),
    case("unsqueeze-int", lambda x: ops.unsqueeze(x, 0), lambda x: x.unsqueeze(0), (3, 4)),
    case("unsqueeze-last", lambda x: ops.unsqueeze(x, -1), lambda x: x.unsqueeze(-1), (3, 4)),
    case("unsqueeze-list", lambda x: ops.unsqueeze(x, [0, 3]), lambda x: _unsqueeze_ref(x, [0, 3]), (3, 4)),
    case("unsqueeze-negatives", lambda x: ops.unsqueeze(x, [-1, -2]), lambda x: _unsqueeze_ref(x, [-1, -2]),
         (3, 4)),
    case("unsqueeze-mixed", lambda x: ops.unsqueeze(x, [1, -1]), lambda x: _unsqueeze_ref(x, [1, -1]), (3, 4)),
    case("gather-0", lambda x, i: ops.gather(x, i), lambda x, i: _take(x, i, 0), (5, 3), _gidx),
    case("gather-1", lambda x, i: ops.gather(x, i, axis=1), lambda x, i: _take(x, i, 1), (3, 5), _gidx),
    case("gather-negative-axis", lambda x, i: ops.gather(x, i, axis=-1), lambda x, i: _take(x, i, 2), (2, 3, 5),
         _gidx),
    case("gather-zero_OOR-negative-axis", lambda x, i: ops.gather(x, i, axis=-1, zero_OOR=True),
         lambda x, i: torch.where((i >= 0) & (i < 5), _take(x, i.clamp(0, 4), 1), 0.0), (3, 5), _oor),
    case("gather-negative-index", lambda x, i: ops.gather(x, i, axis=1), lambda x, i: _take(x, i, 1), (3, 5),
         np.array([-1, 0, -5], np.int32)),
    case("gather-zero_OOR", lambda x, i: ops.gather(x, i, axis=1, zero_OOR=True),
         lambda x, i: torch.where(((i >= 0) & (i < 5))[None, :, :, None], _take(x, i.clamp(0, 4), 1), 0.0),
         (3, 5, 2), _oor),
    case("getitem-int", lambda x: x[1], lambda x: x[1], (3, 4)),
    case("getitem-negative-int", lambda x: x[-1], lambda x: x[-1], (3, 4)),
    case("getitem-slice", lambda x: x[1:3], lambda x: x[1:3], (4, 5)),
    case("getitem-tuple", lambda x: x[1:, 2], lambda x: x[1:, 2], (4, 5)),
    case("getitem-step", lambda x: x[::2, 1::3], lambda x: x[::2, 1::3], (4, 5)),
    case("getitem-negative-step", lambda x: x[::-1], lambda x: _py_slice(x, [slice(None, None, -1)]), (4, 5)),
    case("getitem-int-negative-step", lambda x: x[-1, 3:0:-2],
         lambda x: _py_slice(x, [slice(None), slice(3, 0, -2)])[-1], (4, 5)),
    case("getitem-int-tensor", lambda x, i: x[i], lambda x, i: x[i.long()], (5, 3), _gidx),
    case("getitem-bool-mask", lambda x, m: x[m], lambda x, m: torch.where(m, x, 0.0), (3, 4), bools((3, 4))),
    case("getitem-function", lambda x: ops.getitem(x, (0, slice(1, 3))), lambda x: x[0, 1:3], (2, 4)),
    case("cast-f32", lambda x: ops.cast(x, ipuxl.float32), lambda x: x.float(), (3, 4), atol=1e-6, rtol=1e-6),
    case("cast-int", lambda x: ops.cast(x, ipuxl.int32), lambda x: x.to(torch.int32), randn((3, 4)) * 5,
         grad=False),
    case("cast-from-int", lambda x: ops.cast(x, ipuxl.float64), lambda x: x.double(), ints((3, 4), -9, 9),
         grad=False),
    case("cast-bool", lambda x: ops.cast(x, ipuxl.int32), lambda x: x.to(torch.int32), bools((3,)), grad=False),
    case("onehot", lambda x: ops.onehot(x, 4), lambda x: F.one_hot(x.long(), 4).float(), _labels, grad=False),
    case("onehot-2d", lambda x: ops.onehot(x, 5), lambda x: F.one_hot(x.long(), 5).float(), ints((2, 3), 0, 5),
         grad=False),
    case("detach-partial", lambda x: x * ops.detach(x), lambda x: x * x.detach(), (3, 4)),
    case("detach-method", lambda x, y: x.detach() * y, lambda x, y: x.detach() * y, (3, 4), (3, 4)),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", SHAPE)
def test_shape(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def test_detach_gradient_is_zero():
    check_op(ops.detach, lambda x: x.detach().clone(), [(3, 4)])


def test_detach_has_no_gradient_path_when_required():
    ir = ipuxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda x: ops.detach(x) * 2.0, ipuxl.TensorSpec((3,), ipuxl.float32))
    with pytest.raises(ipuxl.errors.AutodiffError, match="no differentiable path"):
        ipuxl.transforms.autodiff(g, grads_required=[g.inputs[0]])


def test_getitem_rejects_other_keys():
    ir = ipuxl.Ir()
    with ir.main_graph:
        for key in ("a", True, 1.5, [0.5, 1.5]):  # a list is host data: integers gather, booleans mask
            with pytest.raises(InvalidArgumentError, match="cannot index"):
                ipuxl.variable(np.zeros((3,), np.float32))[key]


# -- random ----------------------------------------------------------------------------------------------
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


# -- var_updates ------------------------------------------------------------------------------------------------
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
    # Number factors are float32 in PopART: (1 - f) is 1 - float32(f).
    ("accumulate_moving_average_", vu.accumulate_moving_average_,
     lambda t, x, f: _f32(f) * t + (1 - _f32(f)) * x, 0.9),
    ("accumulate_moving_average_", vu.accumulate_moving_average_, lambda t, x, f: f * t + (1 - f) * x,
     ("tensor", 0.8)),
    ("accumulate_moving_average_square_", vu.accumulate_moving_average_square_,
     lambda t, x, f: _f32(f) * t + (1 - _f32(f)) * x * x, 0.99),
    ("accumulate_moving_average_square_", vu.accumulate_moving_average_square_,
     lambda t, x, f: f * t + (1 - f) * x * x, ("tensor", 0.7)),
    ("accumulator_scale_", lambda t, x, f: vu.accumulator_scale_(t, f), lambda t, x, f: f * t, 0.5),
    ("accumulator_scale_", lambda t, x, f: vu.accumulator_scale_(t, f), lambda t, x, f: f * t, ("tensor", -2.0)),
    ("accumulator_scale_", lambda t, x, f: vu.accumulator_scale_(t, f), lambda t, x, f: 0 * t, 0.0),
    ("accumulator_zero_", lambda t, x, f: vu.accumulator_zero_(t), lambda t, x, f: 0 * t, None),
    ("copy_var_update_", lambda t, x, f: vu.copy_var_update_(t, x), lambda t, x, f: x, None),
]


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


# -- build-time shape errors ------------------------------------------------------------------------------------
SHAPE_ERRORS = [
    ("add", lambda a, b: ops.add(a, b), (2, 3), (4,)),
    ("mul", lambda a, b: a * b, (2, 3), (3, 2)),
    ("matmul", ops.matmul, (2, 3), (4, 5)),
    ("concat", lambda a, b: ops.concat([a, b], axis=0), (2, 3), (2, 4)),
    ("reshape", lambda a, b: ops.reshape(a, (5, 5)), (2, 3), (1,)),
    ("split", lambda a, b: ops.split(a, 4, axis=1), (2, 3), (1,)),
    ("squeeze", lambda a, b: ops.squeeze(a, [1]), (2, 3), (1,)),
    ("unsqueeze", lambda a, b: ops.unsqueeze(a, [0, -4]), (2, 3), (1,)),
    ("where", lambda a, b: ops.where(ops.greater(a, 0.0), a, b), (2, 3), (4,)),
    ("accumulate_", lambda a, b: vu.accumulate_(a, b), (2, 3), (3,)),
    ("accumulate_square_", lambda a, b: vu.accumulate_square_(a, b), (2, 3), (1, 3)),
    ("accumulate_mean_", lambda a, b: vu.accumulate_mean_(a, b, 1.0), (2, 3), (2, 1)),
    ("accumulate_moving_average_", lambda a, b: vu.accumulate_moving_average_(a, b, 0.9), (2, 3), (3, 2)),
    ("accumulate_moving_average_square_", lambda a, b: vu.accumulate_moving_average_square_(a, b, 0.9),
     (2, 3), (6,)),
    ("copy_var_update_", vu.copy_var_update_, (2, 3), (3,)),
    ("sparse_accumulate_", lambda a, b: vu.sparse_accumulate_(a, b, ops.cast(b, ipuxl.int32)[:1]), (2, 3), (2, 4)),
    ("scaled_add_", lambda a, b: ops.scaled_add_(a, b, b=0.5), (2, 3), (3,)),
]


@pytest.mark.parametrize("op_name, fn, shape_a, shape_b", SHAPE_ERRORS, ids=[e[0] for e in SHAPE_ERRORS])
def test_shape_mismatch_raises_at_build_time(op_name, fn, shape_a, shape_b):
    ir = ipuxl.Ir()
    with ir.main_graph:
        a = ipuxl.variable(np.zeros(shape_a, np.float32), name="a")
        b = ipuxl.variable(np.zeros(shape_b, np.float32), name="b")
        with pytest.raises(ShapeMismatchError, match=rf"'{re.escape(op_name)}'") as err:
            fn(a, b)
    assert err.value.where and __file__.rsplit("/", 1)[-1] in err.value.where  # points at the user's line


def test_host_load_after_host_store():
    a0, b0 = randn((2,)), randn((2,), seed=1)

    def build(ir, load):
        a = load("a")
        ops.host_store(ipuxl.d2h_stream(a.shape, a.dtype, "first"), a)
        return {"sum": a + load("b")}

    got = run_main(build, {"a": a0, "b": b0})
    np.testing.assert_allclose(got["sum"], a0 + b0)


# -- calls and repeats (the harness's plumbing, checked directly) ---------------------------------------------
def test_call_and_repeat():
    x0 = randn((3,))

    def build(ir, load):
        g = ir.create_graph(lambda x, y: (x * 2.0 + y, y - 1.0), ipuxl.TensorSpec((3,), ipuxl.float64),
                            ipuxl.TensorSpec((3,), ipuxl.float64))
        x = load("x")
        a, b = ops.call(g, x, x)
        info = ops.call_with_info(g, x, x)
        r, s = ops.repeat(g, 3, x, x)
        r2, _ = ops.repeat_with_info(g, 0, x, x).outputs
        return {"a": a, "b": b, "c": info.outputs[0], "r": r, "s": s, "r2": r2}

    got = run_main(build, {"x": x0})
    np.testing.assert_allclose(got["a"], 3 * x0)
    np.testing.assert_allclose(got["b"], x0 - 1)
    np.testing.assert_allclose(got["c"], 3 * x0)
    x, y = x0, x0
    for _ in range(3):
        x, y = 2 * x + y, y - 1
    np.testing.assert_allclose(got["r"], x)
    np.testing.assert_allclose(got["s"], y)
    np.testing.assert_allclose(got["r2"], x0)


# -- coverage guard ----------------------------------------------------------------------------------------------
def test_every_op_is_tested():
    tests = Path(__file__).parents[1]  # the ops' tests, and Streaming Memory's and placement's own directories
    source = "".join(p.read_text() for d in ("ops", "remote", "multi_ipu") for p in sorted((tests / d).glob("test_*.py")))
    used = set(re.findall(r"\bops\.(\w+)", source)) | set(re.findall(r"\bvu\.(\w+)", source))
    # collectives have their own tests (tests/replication/)
    missing = sorted(n for n in set(ops.__all__) - used - {"var_updates", "collectives"} if not n[0].isupper())
    missing += sorted(f"var_updates.{n}" for n in set(vu.__all__) - used)
    assert not missing, f"ops without a test: {missing}"
