"""The ops added for PopXL parity (#14), forward and gradient, against eager PyTorch / numpy.

Same harness as ``test_ops.py``: each op is built in a subgraph, called from the main
graph on host-loaded data and run in a ``Session``; gradients come from
``transforms.autodiff``. In-place view ops (``reshape_``, ``transpose_``...) are also
checked for aliasing: a write through the result must reach the input.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops
from ipuxl.ir.meta import OP

from ._harness import check_op, randn, run_main, run_op

vu = ops.var_updates


def case(id_, ipuxl_fn, torch_fn, *inputs, marks=(), **kwargs):
    return pytest.param(ipuxl_fn, torch_fn, list(inputs), kwargs, id=id_, marks=marks)


def pos(shape, seed=0):
    return randn(shape, seed=seed, low=0.5, high=2.0)


# -- in-place view ops: values and gradients -------------------------------------------------------
VIEWS = [
    case("reshape_", lambda x: ops.reshape_(x, (4, -1)), lambda x: x.reshape(4, 3), (2, 6)),
    case("flatten_", ops.flatten_, lambda x: x.reshape(-1), (2, 3, 2)),
    case("transpose_", ops.transpose_, lambda x: x.permute(2, 1, 0), (2, 3, 4)),
    case("transpose_-perm", lambda x: ops.transpose_(x, (1, 0, 2)), lambda x: x.permute(1, 0, 2), (2, 3, 4)),
    case("slice_", lambda x: ops.slice_(x, start=[1, 0], stop=[3, 4], step=[1, 2], axis=[0, 1]),
         lambda x: x[1:3, 0:4:2], (4, 5)),
    case("concat_", lambda a, b: ops.concat_([a, b], axis=1), lambda a, b: torch.cat([a, b], 1), (2, 3), (2, 2)),
    case("subsample", lambda x: ops.subsample(x, [2, 1, 3]), lambda x: x[::2, :, ::3], (5, 2, 7)),
    case("detach_-value", ops.detach_, lambda x: x.detach(), (2, 3), grad=False),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", VIEWS)
def test_view_ops(ipuxl_fn, torch_fn, inputs, kwargs):
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


def test_detach_inplace_gradient_is_zero():
    got = run_op(lambda x: ops.add(ops.detach_(ops.identity(x)), x), [randn((2, 3))])
    np.testing.assert_allclose(got["grad"][0], got["dy"][0][1])  # only the non-detached path


@pytest.mark.parametrize("make_alias, write_region", [
    (lambda x: ops.reshape_(x, (3, 4)), lambda e: e.reshape(3, 4).__iadd__(1.0)),
    (lambda x: ops.flatten_(x), lambda e: e.reshape(-1).__iadd__(1.0)),
    (lambda x: ops.transpose_(x), lambda e: e.T.__iadd__(1.0)),
    (lambda x: ops.slice_(x, start=1, stop=3, axis=1), lambda e: e[:, 1:3].__iadd__(1.0)),
    (lambda x: ops.detach_(x), lambda e: e.__iadd__(1.0)),
], ids=["reshape_", "flatten_", "transpose_", "slice_", "detach_"])
def test_inplace_view_writes_reach_the_input(make_alias, write_region):
    x0 = randn((4, 3))

    def build(ir, load):
        x = ipuxl.variable(x0, ipuxl.float64, name="x")
        before = ops.reshape(x, (12,))  # a plain (out-of-place) view made before the write
        alias = make_alias(x)
        ops.add_(alias, 1.0)
        return {"x": x, "before": before, "alias": ops.identity(alias)}

    got = run_main(build)
    expected = torch.from_numpy(x0.copy())
    write_region(expected)
    torch.testing.assert_close(torch.from_numpy(got["x"]), expected)
    torch.testing.assert_close(torch.from_numpy(got["before"]), torch.from_numpy(x0).reshape(12))
    assert got["alias"].shape == tuple(make_alias_shape(make_alias, x0))


def make_alias_shape(make_alias, x0):
    ir = ipuxl.Ir()
    with ir.main_graph:
        return make_alias(ipuxl.variable(x0, ipuxl.float64)).shape


def test_inplace_view_write_to_input_reaches_the_alias():
    x0 = randn((2, 3))

    def build(ir, load):
        x = ipuxl.variable(x0, ipuxl.float64, name="x")
        alias = ops.transpose_(x)
        ops.scaled_add_(x, ops.identity(x), 2.0, 0.0)  # x *= 2 in place
        return {"alias": ops.identity(alias)}

    got = run_main(build)
    np.testing.assert_allclose(got["alias"], 2 * x0.T)


def test_inplace_view_in_a_subgraph_modifies_the_copy_of_its_input():
    # PopXL passes inputs by value: a graph's in-place write does not reach the caller's tensor.
    x0 = randn((2, 3))
    got = run_op(lambda x: (ops.add_(ops.reshape_(x, (6,)), 1.0), x), [x0], grad=False)
    np.testing.assert_allclose(got["out"][0], x0.reshape(6) + 1)
    np.testing.assert_allclose(got["out"][1], x0 + 1)


def test_reshape_of_a_transposed_alias_is_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((2, 3), np.float32))
        with pytest.raises(ValueError, match="cannot share the input's storage"):
            ops.reshape_(ops.transpose_(x), (6,))


def test_slice_inplace_refuses_a_negative_step():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((4,), np.float32))
        with pytest.raises(NotImplementedError, match="negative step"):
            ops.slice_(x, start=3, stop=0, step=-1)


@pytest.mark.parametrize("build, fragment", [
    (lambda x: ops.reshape(x, (0, 6)), "Invalid shape value in reshape"),
    (lambda x: ops.reshape_(x, (-1, -1)), "at most one -1"),
    (lambda x: ops.reshape(x, (-3, 2)), "Invalid shape value in reshape"),
    (lambda x: ops.reshape(x, (5,)), "cannot reshape to"),
    (lambda x: ops.reshape(x, (-1, 4)), "cannot reshape to"),
    (lambda x: ops.squeeze(x, [3]), "out of range"),
    (lambda x: ops.squeeze(x, [0, -3]), "duplicates"),
    (lambda x: ops.squeeze(x, [1]), "not of size 1"),
    (lambda x: ops.transpose(x, (0, 0, 1)), "not a permutation"),
    (lambda x: ops.transpose_(x, (0, 1, 3)), "not a permutation"),
    (lambda x: ops.subsample(x, [1, 0, 1]), "positive stride"),
], ids=["zero", "two-minus-one", "below-minus-one", "count", "count-minus-one", "squeeze-range",
        "squeeze-dup", "squeeze-size", "transpose", "transpose_", "subsample"])
def test_shape_errors_are_value_errors(build, fragment):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((1, 2, 3), np.float32), name="x")
        with pytest.raises(ValueError, match=fragment):
            build(x)


def test_squeeze_negative_axes():
    check_op(lambda x: ops.squeeze(x, [-1, 0]), lambda x: x.squeeze(-1).squeeze(0), [(1, 3, 1)])


# -- element-wise --------------------------------------------------------------------------------------
def _twice(fn):
    """Apply an in-place op to a fresh copy (a graph input may not be written by reference)."""
    return lambda x: fn(ops.identity(x))


UNARY = [
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
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


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


# -- reductions -----------------------------------------------------------------------------------------
def _median_ref(x, dims, keepdim):
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims).reshape(*(x.shape[d] for d in kept), -1)
    out = moved.median(-1).values
    return out.reshape([1 if d in dims else x.shape[d] for d in range(x.dim())]) if keepdim else out


REDUCE = [
    case("logsum", ops.logsum, lambda x: torch.log(x.sum()), pos((3, 4))),
    case("logsum-axis", lambda x: ops.logsum(x, 1, keepdims=True), lambda x: torch.log(x.sum(1, keepdim=True)),
         pos((3, 4))),
    case("logsum-axes", lambda x: ops.logsum(x, [0, 2]), lambda x: torch.log(x.sum((0, 2))), pos((2, 3, 4))),
    case("median-all", ops.median, lambda x: x.reshape(-1).median(), (3, 5)),
    case("median-axis", lambda x: ops.median(x, 1), lambda x: x.median(1).values, (3, 5)),
    case("median-even-lower", lambda x: ops.median(x, -1, keepdims=True), lambda x: x.median(-1, True).values,
         (3, 4)),
    case("median-axes", lambda x: ops.median(x, [0, 2], True), lambda x: _median_ref(x, [0, 2], True), (3, 2, 3)),
    case("cumsum", ops.cumsum, lambda x: torch.cumsum(x, 0), (4, 3)),
    case("cumsum-dim", lambda x: ops.cumsum(x, -1), lambda x: torch.cumsum(x, -1), (4, 3)),
    case("cumsum-int", lambda x: ops.cumsum(x, 1), lambda x: torch.cumsum(x, 1, dtype=torch.int32),
         np.arange(12, dtype=np.int32).reshape(3, 4), grad=False),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", REDUCE)
def test_reduce(ipuxl_fn, torch_fn, inputs, kwargs):
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


def test_median_even_count_is_the_lower_middle_value():
    out = run_op(ops.median, [np.array([4.0, 1.0, 3.0, 2.0])], grad=False)["out"][0]
    assert out == 2.0  # numpy.median would give 2.5


# -- signatures -------------------------------------------------------------------------------------------
def test_identity_output_name():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((2,), np.float32), name="x")
        assert ops.identity(x).name == "identity_x"
        assert ops.identity(x, output_name="renamed").name == "renamed"


ONEHOT = [
    case("int-classes", lambda t: ops.onehot(t, 4), lambda t: F.one_hot(t.long(), 4).float(),
         np.array([0, 3, 1, 2], np.int32), grad=False),
    case("tensor-classes-values-axis0",
         lambda t, v: ops.onehot(t, ipuxl.constant(np.array(3, np.int32)), v, axis=0),
         lambda t, v: torch.where(F.one_hot(t.long(), 3).bool(), v[1], v[0]).T,
         np.array([2, 0, 1, 1], np.int32), np.array([-1.0, 5.0]), grad=False),
    case("negative-index", lambda t, v: ops.onehot(t, 3, v, -1),
         lambda t, v: torch.where(F.one_hot(t.long() % 3, 3).bool(), v[1], v[0]),
         np.array([[-1, 0], [2, -3]], np.int32), np.array([0.0, 1.0]), grad=False),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", ONEHOT)
def test_onehot(ipuxl_fn, torch_fn, inputs, kwargs):
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


def test_onehot_values_gradient():
    check_op(lambda t, v: ops.onehot(t, 3, v), lambda t, v: torch.where(F.one_hot(t.long(), 3).bool(), v[1], v[0]),
             [np.array([0, 2, 2], np.int32), np.array([0.5, 2.0])])


def test_onehot_num_classes_must_be_known():
    ir = ipuxl.Ir()
    with ir.main_graph:
        t = ipuxl.variable(np.zeros((2,), np.int32), name="t")
        n = ipuxl.variable(np.array(3, np.int32), name="n")
        with pytest.raises(TypeError, match="scalar constant"):
            ops.onehot(t, n, ipuxl.constant(np.array([0.0, 1.0], np.float32)), 0)


# -- convolution and pooling ------------------------------------------------------------------------------
def _pad(x, pads, value=0.0):
    n = len(pads) // 2
    return F.pad(x, [p for a in reversed(range(n)) for p in (pads[a], pads[n + a])], value=value)


def _avg_pool_ref(x, kernel, stride, pads, ceil_mode=False):
    """ONNX AveragePool without counting padding: the mean of the window's input elements."""
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[len(kernel)]
    ones = torch.ones_like(x)
    total = pool(_pad(x, pads), kernel, stride, 0, ceil_mode, True)
    return total / pool(_pad(ones, pads), kernel, stride, 0, ceil_mode, True)


CONV = [
    case("conv1d", lambda x, w: ops.conv(x, w, (2,), (1, 1)), lambda x, w: F.conv1d(x, w, None, 2, 1),
         (2, 3, 9), (4, 3, 3)),
    case("conv1d-defaults", ops.conv, F.conv1d, (2, 3, 9), (4, 3, 3)),
    case("conv3d", lambda x, w: ops.conv(x, w, (1, 2, 1), (1, 0, 1, 1, 0, 1)),
         lambda x, w: F.conv3d(x, w, None, (1, 2, 1), (1, 0, 1)), (1, 2, 4, 5, 4), (3, 2, 2, 3, 2)),
    case("conv-asymmetric-padding", lambda x, w: ops.conv(x, w, padding=(0, 1, 2, 1)),
         lambda x, w: F.conv2d(_pad(x, (0, 1, 2, 1)), w), (1, 2, 5, 5), (3, 2, 3, 3)),
    case("conv-positional-groups-dilation", lambda x, w: ops.conv(x, w, (1, 1), (0, 0, 0, 0), (2, 1), 2, "not_set",
                                                                  [0.5]),
         lambda x, w: F.conv2d(x, w, None, 1, 0, (2, 1), 2), (1, 4, 7, 6), (2, 2, 2, 2)),
    case("conv-same_upper", lambda x, w: ops.conv(x, w, (2, 2), pad_type="same_upper"),
         lambda x, w: F.conv2d(_pad(x, (0, 0, 1, 1)), w, None, 2), (1, 2, 6, 5), (3, 2, 3, 2)),
    case("conv-same_lower", lambda x, w: ops.conv(x, w, (2, 2), pad_type="same_lower"),
         lambda x, w: F.conv2d(_pad(x, (1, 1, 0, 0)), w, None, 2), (1, 2, 6, 5), (3, 2, 3, 2)),
    case("conv-valid", lambda x, w: ops.conv(x, w, padding=(1, 1, 1, 1), pad_type="valid"), F.conv2d,
         (1, 2, 5, 5), (3, 2, 3, 3)),
    case("conv_transpose", ops.conv_transpose, F.conv_transpose2d, (2, 3, 4, 5), (3, 2, 3, 3)),
    case("conv_transpose-stride-pad-outpad", lambda x, w: ops.conv_transpose(x, w, (2, 2), (1, 0, 1, 0),
                                                                             output_padding=(1, 1)),
         lambda x, w: F.conv_transpose2d(x, w, None, 2, (1, 0), (1, 1)), (1, 3, 4, 4), (3, 2, 3, 3)),
    case("conv_transpose-asymmetric", lambda x, w: ops.conv_transpose(x, w, padding=(1, 0, 0, 2)),
         lambda x, w: F.conv_transpose2d(x, w)[:, :, 1:, :-2], (1, 2, 4, 5), (2, 2, 3, 3)),
    case("conv_transpose-groups-dilation-1d", lambda x, w: ops.conv_transpose(x, w, (2,), (0, 0), (2,), 2),
         lambda x, w: F.conv_transpose1d(x, w, None, 2, 0, 0, 2, 2), (1, 4, 5), (4, 3, 3)),
    case("conv_transpose-output_shape", lambda x, w: ops.conv_transpose(x, w, (2, 2), output_shape=(8, 7)),
         lambda x, w: F.conv_transpose2d(x, w, None, 2)[:, :, 0:8, 0:7], (1, 2, 4, 4), (2, 3, 2, 2)),
    case("max_pool-padding-ceil", lambda x: ops.max_pool(x, (3, 3), (2, 2), (1, 1, 1, 1), ceil_mode=True),
         lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True), (1, 2, 6, 7)),
    case("max_pool-asymmetric", lambda x: ops.max_pool(x, (2, 2), (2, 2), (1, 0, 0, 1)),
         lambda x: F.max_pool2d(_pad(x, (1, 0, 0, 1), -np.inf), 2, 2), (1, 2, 5, 5)),
    case("max_pool-dilation-1d", lambda x: ops.max_pool(x, (2,), (1,), dilation=(2,)),
         lambda x: F.max_pool1d(x, 2, 1, dilation=2), (2, 3, 8)),
    case("max_pool-3d", lambda x: ops.max_pool(x, (2, 2, 2), (2, 1, 2)),
         lambda x: F.max_pool3d(x, 2, (2, 1, 2)), (1, 2, 4, 4, 4)),
    case("max_pool-same_upper", lambda x: ops.max_pool(x, (3, 3), (2, 2), auto_pad="same_upper"),
         lambda x: F.max_pool2d(_pad(x, (0, 1, 1, 1), -np.inf), 3, 2), (1, 1, 6, 5)),
    case("average_pool-padding-not-counted", lambda x: ops.average_pool(x, (3, 3), (2, 2), (1, 1, 1, 1)),
         lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), (1, 2, 7, 6)),
    case("average_pool-asymmetric", lambda x: ops.average_pool(x, (2, 3), (1, 2), (0, 1, 1, 0)),
         lambda x: _avg_pool_ref(x, (2, 3), (1, 2), (0, 1, 1, 0)), (1, 2, 5, 6)),
    case("average_pool-ceil-1d", lambda x: ops.average_pool(x, (2,), (2,), ceil_mode=True),
         lambda x: F.avg_pool1d(x, 2, 2, ceil_mode=True), (2, 3, 7)),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", CONV)
def test_conv_and_pool(ipuxl_fn, torch_fn, inputs, kwargs):
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


def test_pool_output_shapes_for_stride_other_than_kernel():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((1, 1, 7, 7), np.float32))
        assert ops.max_pool(x, (3, 3)).shape == (1, 1, 5, 5)  # stride defaults to 1, not the kernel
        assert ops.max_pool(x, (3, 3), (2, 2)).shape == (1, 1, 3, 3)
        assert ops.average_pool(x, (2, 2), (2, 2), ceil_mode=True).shape == (1, 1, 4, 4)


@pytest.mark.parametrize("build, error, fragment", [
    (lambda x, w: ops.conv(x, w, pad_type="same"), ValueError, "pad type 'same'"),
    (lambda x, w: ops.conv(x, w, stride=(1, 2, 3)), ValueError, "needs 2 values"),
    (lambda x, w: ops.max_pool(x, (2, 2), out_pads=(1, 1, 1, 1)), NotImplementedError, "out_pads"),
    (lambda x, w: ops.average_pool(x, (2, 2), dilation=(2, 2)), NotImplementedError, "dilation"),
    (lambda x, w: ops.max_pool(x, (2, 2, 2)), ValueError, "3 spatial axes"),
], ids=["pad-type", "stride-length", "out_pads", "avg-dilation", "rank"])
def test_conv_and_pool_errors(build, error, fragment):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((1, 2, 5, 5), np.float32), name="x")
        w = ipuxl.variable(np.zeros((3, 2, 3, 3), np.float32), name="w")
        with pytest.raises(error, match=fragment):
            build(x, w)


# -- dynamic slices, scatters, top-k, histogram ------------------------------------------------------------
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


# -- normalisation, interpolate, roi_align -------------------------------------------------------------------
NORM = [
    case("group_norm", lambda x, w, b: ops.group_norm(x, w, b, 2), lambda x, w, b: F.group_norm(x, 2, w, b),
         (2, 4, 3, 3), (4,), (4,)),
    case("group_norm-2d-eps", lambda x, w, b: ops.group_norm(x, w, b, 1, eps=1e-2),
         lambda x, w, b: F.group_norm(x, 1, w, b, 1e-2), (3, 6), (6,), (6,)),
    case("batch_norm_inference",
         lambda x, s, b, m, v: ops.batch_norm_inference(x, s, b, m, v, 1e-3),
         lambda x, s, b, m, v: (x - m[:, None, None]) / torch.sqrt(v[:, None, None] + 1e-3) * s[:, None, None]
         + b[:, None, None], (2, 3, 2, 2), (3,), (3,), (3,), pos((3,))),
    case("interpolate-nearest-default", lambda x: ops.interpolate(x, (1.0, 1.0, 2.0, 2.0)),
         lambda x: x.repeat_interleave(2, 2).repeat_interleave(2, 3), (1, 2, 3, 4)),
    case("interpolate-nearest-asymmetric-floor",
         lambda x: ops.interpolate(x, (1, 1, 1.5, 2.5), nearest_mode="floor",
                                   coordinate_transformation_mode="asymmetric"),
         lambda x: F.interpolate(x, scale_factor=(1.5, 2.5), mode="nearest"), (1, 2, 4, 4)),
    case("interpolate-nearest-exact", lambda x: ops.interpolate(x, (1, 1, 3.0, 0.5), nearest_mode="round_prefer_ceil"),
         lambda x: F.interpolate(x, scale_factor=(3.0, 0.5), mode="nearest-exact"), (1, 1, 3, 6)),
    case("interpolate-linear", lambda x: ops.interpolate(x, (1, 1, 2.0, 1.5), "linear"),
         lambda x: F.interpolate(x, scale_factor=(2.0, 1.5), mode="bilinear"), (2, 2, 3, 4)),
    case("interpolate-linear-align_corners",
         lambda x: ops.interpolate(x, (1, 1, 2.0, 2.0), "linear", coordinate_transformation_mode="align_corners"),
         lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=True), (1, 2, 3, 4)),
    case("interpolate-cubic", lambda x: ops.interpolate(x, (1, 1, 2.0, 2.0), "cubic"),
         lambda x: F.interpolate(x, scale_factor=2.0, mode="bicubic"), (1, 2, 4, 5)),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", NORM)
def test_norm_and_interpolate(ipuxl_fn, torch_fn, inputs, kwargs):
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


def test_interpolate_round_prefer_floor_at_halfway():
    # half_pixel with scale 2 on length 1 -> source coordinate (x + 0.5) / 2 - 0.5 of 0 and 1: -0.25, 0.25;
    # scale 0.5 on length 4 -> 0.5 and 2.5, halfway: round_prefer_floor takes 0 and 2.
    out = run_op(lambda t: ops.interpolate(t, (0.5,)), [np.arange(4.0)], grad=False)["out"][0]
    np.testing.assert_array_equal(out, [0.0, 2.0])
    out = run_op(lambda t: ops.interpolate(t, (0.5,), nearest_mode="round_prefer_ceil"), [np.arange(4.0)],
                 grad=False)["out"][0]
    np.testing.assert_array_equal(out, [1.0, 3.0])


def test_roi_align_matches_torchvision():
    tv_ops = pytest.importorskip("torchvision.ops")
    x = randn((2, 3, 8, 9))
    rois = np.array([[0.5, 1.0, 6.0, 7.5], [2.0, 0.0, 9.5, 3.0], [-1.0, -0.5, 3.0, 2.0]])
    batch = np.array([1, 0, 1], np.int32)

    def ref(t, r, b):
        return tv_ops.roi_align(t, torch.cat([b[:, None].to(t.dtype), r], 1), (3, 2), 0.75, 2, aligned=False)

    check_op(lambda t, r, b: ops.roi_align(t, r, b, (3, 2), 0.75, 2), ref, [x, rois, batch], grad_inputs=[0],
             atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("build, fragment", [
    (lambda x: ops.group_norm(x, x, x, 3), "groups do not divide"),
    (lambda x: ops.interpolate(x, (2.0,)), "one scale per axis"),
    (lambda x: ops.interpolate(x, mode="area"), "mode 'area'"),
    (lambda x: ops.interpolate(x, coordinate_transformation_mode="crop"), "not valid"),
    (lambda x: ops.roi_align(x, x, x, (2, 2), 1.0, 0), "needs t"),
], ids=["group_norm", "scales", "mode", "coords", "roi_align"])
def test_norm_and_interpolate_errors(build, fragment):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((1, 2, 3, 3), np.float32), name="x")
        with pytest.raises(ValueError, match=fragment):
            build(x)


@pytest.mark.parametrize("build, fragment", [
    (lambda x, r, b: ops.interpolate(x, coordinate_transformation_mode="tf_crop_and_resize"), "tf_crop_and_resize"),
    (lambda x, r, b: ops.roi_align(x, r, b, (2, 2), 1.0, 0), "sampling_ratio 0"),
], ids=["tf_crop_and_resize", "adaptive-sampling"])
def test_unsupported_options_say_so(build, fragment):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((1, 2, 3, 3), np.float32), name="x")
        r = ipuxl.variable(np.zeros((2, 4), np.float32), name="r")
        b = ipuxl.variable(np.zeros((2,), np.int32), name="b")
        with pytest.raises(NotImplementedError, match=fragment):
            build(x, r, b)


# -- random, seeds, unsigned arithmetic, optimiser updates --------------------------------------------------
def _seed(value):
    return ipuxl.create_seeds(value)


def test_create_seeds_are_popxls():
    # PopXL: one uint64 per seed from default_rng(seed + offset) over the full range, split high/low.
    values = np.random.default_rng(7 + 3).integers(0, 2**64 - 1, endpoint=True, dtype=np.uint64, size=6)
    expected = np.array([[int(v) >> 32, int(v) & 0xFFFFFFFF] for v in values], np.uint32).reshape(3, 1, 2, 2)
    got = ipuxl.create_seeds(7, offset=3, batches_per_step=3, replicas=2)
    np.testing.assert_array_equal(got, expected.squeeze(1))
    assert got.dtype == np.uint32


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


@pytest.mark.parametrize("shape", [(4, 1), (1, 6), (6,)])
def test_shaped_dropout_mask_is_shared_along_broadcast_axes(shape):
    x = randn((4, 6)) + 3.0  # away from 0, so a dropped element is recognisable

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


# -- init, print_tensor ---------------------------------------------------------------------------------------
def test_init_zero_in_a_subgraph_is_fresh_each_call():
    x0 = randn((2, 3))

    def body(x):
        acc = ops.init((2, 3), ipuxl.float64, "acc")
        return ops.add_(acc, x)

    def build(ir, load):
        graph = ir.create_graph(body, ipuxl.TensorSpec((2, 3), ipuxl.float64))
        x = load("x")
        (first,) = ops.call(graph, x)
        (second,) = ops.call(graph, x)
        return {"first": first, "second": second}

    got = run_main(build, {"x": x0})
    np.testing.assert_allclose(got["first"], x0)
    np.testing.assert_allclose(got["second"], x0)  # not 2 * x0: init is not a variable


def test_init_spec_and_errors():
    ir = ipuxl.Ir()
    with ir.main_graph:
        t = ops.init([3, 1], ipuxl.int32, "buf", "undef")
        assert t.shape == (3, 1) and t.dtype == ipuxl.int32 and t.name == "buf"
        with pytest.raises(ValueError, match="init_type"):
            ops.init([2], ipuxl.float32, init_type="ones")


def test_print_tensor_prints_at_run_time_and_returns_its_input(capsys):
    x0 = np.array([[1.5, -2.0]])

    def build(ir, load):
        y = ops.print_tensor(load("x"), "my x")
        return {"y": y * 2}

    capsys.readouterr()
    got = run_main(build, {"x": x0})
    np.testing.assert_allclose(got["y"], 2 * x0)
    assert "my x: [[1.5, -2.0]] (shape (1, 2), torch.float64)" in capsys.readouterr().out


def test_print_tensor_prints_the_gradient(capsys):
    x0 = np.array([1.0, 2.0, 3.0])
    capsys.readouterr()
    got = run_op(lambda x: ops.print_tensor(x, "t", print_self=False, print_gradient=True) * 3.0, [x0])
    out = capsys.readouterr().out
    dy = got["dy"][0][1]
    assert f"t gradient: {(dy * 3.0).tolist()}" in out
    assert not any(line.startswith("t: ") for line in out.splitlines())  # print_self=False
    np.testing.assert_allclose(got["grad"][0], 3.0 * dy)


# -- autodiff through replicated_all_gather ---------------------------------------------------------------
@pytest.mark.parametrize("mode, axis", [("concat", 0), ("concat", 1), ("new_axis", 0)])
def test_all_gather_gradient_is_a_reduce_scatter(mode, axis):
    replicas = 2
    x = randn((replicas, 2, 3))  # per replica
    dy_shape = (replicas, 2, 3)[1:]
    dy_shape = (replicas,) + dy_shape if mode == "new_axis" else tuple(
        d * replicas if i == axis else d for i, d in enumerate(dy_shape))
    dy = randn((replicas, *dy_shape), seed=1)
    scale = randn(dy_shape, seed=2)

    ir = ipuxl.Ir(replication=replicas)
    with ir.main_graph:
        xs, dys = ipuxl.h2d_stream((2, 3), ipuxl.float64, "x"), ipuxl.h2d_stream(dy_shape, ipuxl.float64, "dy")

        def body(t):
            return ops.collectives.replicated_all_gather(t, axis, output_shape=mode) * ipuxl.constant(scale, name="c")

        graph = ir.create_graph(body, ipuxl.TensorSpec((2, 3), ipuxl.float64))
        fwd = ops.call_with_info(graph, ops.host_load(xs))
        info = ipuxl.transforms.autodiff(graph)
        (dx,) = ops.call(info.graph, ops.host_load(dys), inputs_dict=info.inputs_dict(fwd))
        outs = {}
        for name, t in (("y", fwd.outputs[0]), ("dx", dx)):
            outs[name] = ipuxl.d2h_stream(t.shape, t.dtype, name)
            ops.host_store(outs[name], t)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run({xs: x, dys: dy})

    xt, dyt, ct = (torch.from_numpy(a).requires_grad_(i == 0) for i, a in enumerate((x, dy, scale)))
    gathered = torch.stack(list(xt)) if mode == "new_axis" else torch.cat(list(xt), axis)
    y = gathered * ct  # every replica computes the same y from all inputs
    (expected_dx,) = torch.autograd.grad([y] * replicas, [xt], list(dyt))
    torch.testing.assert_close(torch.from_numpy(got[outs["y"]]), torch.stack([y.detach()] * replicas))
    torch.testing.assert_close(torch.from_numpy(got[outs["dx"]]), expected_dx)


def test_autodiff_still_refuses_other_collectives():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        x = ipuxl.variable(np.ones(3, np.float32), name="x")
        graph = ir.create_graph(lambda t: ops.collectives.replicated_all_reduce(t), x)
        with pytest.raises(ValueError, match="contains replicated_all_reduce"):
            ipuxl.transforms.autodiff(graph)


def test_autodiff_of_a_subgraph_reading_a_constant():
    c = np.arange(6.0).reshape(2, 3)
    check_op(lambda x: x * ipuxl.constant(c, name="c"), lambda x: x * torch.from_numpy(c), [(2, 3)])


# -- conditional ---------------------------------------------------------------------------------------------
def _branches(ir):
    spec = ipuxl.TensorSpec((2, 3), ipuxl.float64)
    then_branch = ir.create_graph(lambda x, y: (x * x + y, ops.sum(x)), spec, spec)
    else_branch = ir.create_graph(lambda y: (ops.sin(y) - 1.0, ops.sum(y) * 0.0), spec)
    return then_branch, else_branch


def _conditional_ref(x, y, c):
    picked = bool((c > 0).item())
    return (x * x + y, x.sum()) if picked else (torch.sin(y) - 1.0, y.sum() * 0.0)


@pytest.mark.parametrize("flag", [1, -1], ids=["then", "else"])
def test_conditional_values_and_gradients(flag):
    def build(x, y, c):
        then_branch, else_branch = _branches(ipuxl.gcg().ir)
        return ops.conditional(ops.greater(c, 0), then_branch, else_branch, [x, y], else_inputs_dict={
            else_branch.inputs[0]: y})

    check_op(build, _conditional_ref, [(2, 3), (2, 3), np.array([flag], np.int32)])


@pytest.mark.parametrize("flag", [1, -1], ids=["then", "else"])
def test_conditional_gradient_ignores_the_branch_not_taken(flag):
    """On negative x, sqrt's gradient is NaN: a branch that is not taken must not leak it
    (PopXL runs one branch; eager picks with Python's ``if``)."""
    def build(x, c):
        spec = ipuxl.TensorSpec((2, 3), ipuxl.float64)
        ir = ipuxl.gcg().ir
        sqrt_branch = ir.create_graph(lambda v: ops.sqrt(v) * 2.0, spec)
        negate_branch = ir.create_graph(lambda v: v * -3.0, spec)
        return ops.conditional(ops.greater(c, 0), sqrt_branch, negate_branch, [x], [x])

    def reference(x, c):
        return torch.sqrt(x) * 2.0 if flag > 0 else x * -3.0

    low, high = (0.5, 2.0) if flag > 0 else (-2.0, -0.5)  # the branch taken sees valid data only
    got = check_op(build, reference, [(2, 3), np.array([flag], np.int32)], low=low, high=high)
    assert np.isfinite(np.asarray(got["grad"][0])).all()


def test_conditional_with_info_maps_both_branches():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((2, 3)), ipuxl.float64, name="x")
        y = ipuxl.variable(np.ones((2, 3)), ipuxl.float64, name="y")
        cond = ipuxl.constant(np.array(True), name="cond")
        then_branch, else_branch = _branches(ir)
        info = ops.conditional_with_info(cond, then_branch, else_branch, [x, y], [y])
        assert info.called_graph == (then_branch, else_branch)
        assert info.inputs == (cond, x, y, y) and len(info.outputs) == 2
        assert info.graph_to_parent_input_index(0, then_branch=False) == 3
        assert info.parent_to_graph_input_index(2) == 1 and info.is_parent_index_in_then_branch(2)
        assert not info.is_parent_index_in_then_branch(3)
        assert info.graph_to_parent(else_branch.inputs[0]) is y
        assert info.graph_to_parent(then_branch.outputs[1]) is info.outputs[1]
        assert info.parent_to_graph(x) is then_branch.inputs[0]
        with pytest.raises(IndexError):
            info.parent_to_graph_input_index(0)
        with pytest.raises(NotImplementedError):
            info.set_parent_input_modified(x)


def test_conditional_in_main_graph_picks_at_run_time():
    x0 = randn((2, 3))

    def build(ir, load):
        then_branch, else_branch = _branches(ir)
        x = load("x")
        out_then = ops.conditional(ops.greater(load("a"), 0), then_branch, else_branch, [x, x], [x])
        out_else = ops.conditional(ops.greater(load("b"), 0), then_branch, else_branch, [x, x], [x])
        return {"then": out_then[0], "else": out_else[0]}

    got = run_main(build, {"x": x0, "a": np.array(1, np.int32), "b": np.array(0, np.int32)})
    np.testing.assert_allclose(got["then"], x0 * x0 + x0)
    np.testing.assert_allclose(got["else"], np.sin(x0) - 1.0)


@pytest.mark.parametrize("flag", [1, 0], ids=["then", "else"])
def test_conditional_by_reference_inputs_are_written_by_the_taken_branch_only(flag):
    """A conditional update, as PopXL runs it: w and v are passed by reference to both
    branches, each branch writes them differently; only the taken branch's writes stay,
    and its outputs are the conditional's."""
    w0, v0, d0 = randn((2, 3), seed=1), randn((2, 3), seed=2), randn((2, 3), seed=3)

    def build(ir, load):
        spec = ipuxl.TensorSpec((2, 3), ipuxl.float64)
        w = ipuxl.variable(w0, ipuxl.float64, name="w")
        v = ipuxl.variable(v0, ipuxl.float64, name="v")

        def step(w: ipuxl.TensorByRef, v: ipuxl.TensorByRef, d):  # w += d, v *= 2
            ops.scaled_add_(w, d)
            ops.var_updates.copy_var_update_(v, v * 2.0)
            return w + v

        def skip(w: ipuxl.TensorByRef, v: ipuxl.TensorByRef):  # v = -v, w untouched
            ops.var_updates.copy_var_update_(v, -v)
            return w - v

        then_branch = ir.create_graph(step, spec, spec, spec)
        else_branch = ir.create_graph(skip, spec, spec)
        (out,) = ops.conditional(ops.greater(load("flag"), 0), then_branch, else_branch, [w, v, load("d")], [w, v])
        return {"w": w, "v": v, "out": out}

    got = run_main(build, {"flag": np.array(flag, np.int32), "d": d0})
    w, v = torch.tensor(w0), torch.tensor(v0)
    if flag:
        w, v = w + torch.tensor(d0), v * 2.0
        out = w + v
    else:
        v = -v
        out = w - v
    for key, expected in (("w", w), ("v", v), ("out", out)):
        torch.testing.assert_close(torch.from_numpy(np.asarray(got[key])), expected, msg=key)


def test_conditional_errors():
    ir = ipuxl.Ir()
    with ir.main_graph:
        spec = ipuxl.TensorSpec((2,), ipuxl.float32)
        x = ipuxl.variable(np.zeros(2, np.float32), name="x")
        cond = ipuxl.constant(np.array(True), name="cond")
        plain = ir.create_graph(lambda t: t + 1.0, spec)
        printing = ir.create_graph(lambda t: ops.print_tensor(t, "t"), spec)
        two = ir.create_graph(lambda t: (t, t), spec)
        wide = ir.create_graph(lambda t: ops.concat([t, t]), spec)
        with pytest.raises(ValueError, match="contains print_tensor"):
            ops.conditional(cond, plain, printing, [x], [x])
        with pytest.raises(ValueError, match="same number of outputs: 1 != 2"):
            ops.conditional(cond, plain, two, [x], [x])
        with pytest.raises(ValueError, match="same shapes and dtypes"):
            ops.conditional(cond, plain, wide, [x], [x])
        with pytest.raises(ValueError, match="boolean single-value"):
            ops.conditional(x, plain, plain, [x], [x])
        with pytest.raises(ValueError, match="boolean single-value"):
            ops.conditional(ipuxl.constant(np.array(1, np.int32)), plain, plain, [x], [x])
        with pytest.raises(ValueError, match="is not an input of"):
            ops.conditional(cond, plain, plain, [x], else_inputs_dict={x: x})


def test_autodiff_keeps_the_all_gather_a_collective():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        graph = ir.create_graph(lambda t: ops.collectives.replicated_all_gather(t) * 2.0,
                                ipuxl.TensorSpec((3,), ipuxl.float32))
        ipuxl.transforms.autodiff(graph)
    ops_in_forward = [n.meta.get(OP) for n in graph.fx.nodes]
    assert "replicated_all_gather" in ops_in_forward
