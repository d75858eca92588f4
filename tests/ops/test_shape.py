"""The shape ops (``ipuxl.ops.shape``), forward and gradient, against eager PyTorch; in-place view
ops (``reshape_``, ``transpose_``...) are also checked for aliasing: a write through the result
must reach the input."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import InvalidArgumentError

from ._harness import bools, case, check_op, ints, randn, run_case, run_main, run_op


_labels = np.array([0, 2, 1, 2, 3], np.int32)


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


@pytest.mark.parametrize("op", [ops.concat, ops.concat_])
def test_concat_of_two_dtypes_is_popxls_type_error(op):
    ir = ipuxl.Ir()
    with ir.main_graph:
        a = ipuxl.variable(np.ones((2, 2), np.float32))
        b = ipuxl.variable(np.ones((2, 2), np.float16))
        with pytest.raises(TypeError, match=r"All inputs to a concat operation must have the same type: "
                                            r"\[float32, float16\]") as info:
            op([a, b], 0)
    assert isinstance(info.value, InvalidArgumentError) and "ops.cast" in info.value.fix
