"""``ops.conditional`` (``ipuxl.ops.conditional``): the branch taken at run time, values and
gradients, by-reference inputs, and its errors, against eager PyTorch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops

from ._harness import check_op, randn, run_main


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
        buffer = ipuxl.remote_buffer((2,), ipuxl.float32, 1)


        def store_remotely(t):
            ops.remote_store(buffer, 0, t)
            return t + 1.0

        storing = ir.create_graph(store_remotely, spec)
        two = ir.create_graph(lambda t: (t, t), spec)
        wide = ir.create_graph(lambda t: ops.concat([t, t]), spec)
        with pytest.raises(ValueError, match="contains print_tensor"):
            ops.conditional(cond, plain, printing, [x], [x])
        with pytest.raises(ValueError, match=r"contains a Streaming Memory write \(remote_store\)"):
            ops.conditional(cond, storing, plain, [x], [x])
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


def _loop_with_conditional_transfers(flags, data, twice=False):
    """A device loop of ``len(flags)`` steps: each loads a flag and a value ``v``; the then
    branch loads ``data``, stores ``d * v`` and returns ``d + v``, the else branch loads
    ``data`` too and returns ``v - d``. With ``twice`` a second conditional on ``not flag``
    follows with the same branches (their select graph then has two call sites, and each
    step loads ``data`` twice: the run has ``2 * steps`` slices, of which the loop reads
    the first ``steps`` of ``flag`` and ``v``)."""
    steps = len(flags)
    slices = 2 * steps if twice else steps
    ir = ipuxl.Ir()
    ir.num_host_transfers = slices
    spec = ipuxl.TensorSpec((3,), ipuxl.float32)
    with ir.main_graph:
        flag_in = ipuxl.h2d_stream((), ipuxl.bool, "flag")
        v_in = ipuxl.h2d_stream((3,), ipuxl.float32, "v")
        data_in = ipuxl.h2d_stream((3,), ipuxl.float32, "data")
        stored = ipuxl.d2h_stream((3,), ipuxl.float32, "stored")
        result = ipuxl.d2h_stream((3,), ipuxl.float32, "result")

        def then_fn(v):
            d = ops.host_load(data_in)
            ops.host_store(stored, d * v)
            return d + v

        then_branch = ir.create_graph(then_fn, spec)
        else_branch = ir.create_graph(lambda v: v - ops.host_load(data_in), spec)

        def step():
            flag, v = ops.host_load(flag_in), ops.host_load(v_in)
            (out,) = ops.conditional(flag, then_branch, else_branch, [v], [v])
            if twice:
                (out,) = ops.conditional(ops.logical_not(flag), then_branch, else_branch, [out], [out])
            ops.host_store(result, out)

        ops.repeat(ir.create_graph(step), steps)
    values = np.random.default_rng(3).standard_normal((slices, 3)).astype(np.float32)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run({flag_in: np.array(flags + flags[:slices - steps]), v_in: values, data_in: data})
    return got[stored], got[result][:steps], values[:steps]


def _eager_loop(flags, data, values, twice, slices):
    """The same loop in torch: each executed load takes the stream's next slice."""
    data_slices, stored = iter(torch.from_numpy(data)), []
    results = []
    for flag, v in zip(flags, torch.from_numpy(values)):
        out = v
        for take_then in ([flag, not flag] if twice else [flag]):
            d = next(data_slices)
            if take_then:
                stored.append(d * out)
                out = d + out
            else:
                out = out - d
        results.append(out)
    buffer = torch.zeros(slices, 3)  # slices no executed store filled stay zero
    if stored:
        buffer[:len(stored)] = torch.stack(stored)
    return buffer, torch.stack(results)


@pytest.mark.parametrize("twice", [False, True], ids=["one call site", "two call sites"])
@pytest.mark.parametrize("flags", [[True, False, True, False], [False, False, False, False], [True] * 4])
def test_only_the_branch_taken_transfers_host_data(flags, twice):
    """PopXL's conditional runs one branch: its loads take the next slices, the other
    branch's take none (with two branches loading one stream, one slice per conditional)."""
    slices = 2 * len(flags) if twice else len(flags)
    data = np.arange(slices * 3, dtype=np.float32).reshape(slices, 3) + 1.0
    stored, result, values = _loop_with_conditional_transfers(flags, data, twice)
    expected_stored, expected_result = _eager_loop(flags, data, values, twice, slices)
    torch.testing.assert_close(torch.from_numpy(result), expected_result)
    torch.testing.assert_close(torch.from_numpy(stored), expected_stored)


def test_a_stream_loaded_in_both_branches_counts_once_per_conditional():
    """Both branches load ``data`` once, so each conditional loads it once (not twice):
    two conditionals per step of a 4-step loop are 8 loads, more than 4 slices."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = 4
    spec = ipuxl.TensorSpec((3,), ipuxl.float32)
    with ir.main_graph:
        data_in = ipuxl.h2d_stream((3,), ipuxl.float32, "data")
        then_branch = ir.create_graph(lambda v: v + ops.host_load(data_in), spec)
        else_branch = ir.create_graph(lambda v: v - ops.host_load(data_in), spec)

        def step():
            v, flag = ipuxl.constant(np.zeros(3, np.float32)), ipuxl.constant(np.array(True))
            (out,) = ops.conditional(flag, then_branch, else_branch, [v], [v])
            ops.conditional(flag, then_branch, else_branch, [out], [out])

        ops.repeat(ir.create_graph(step), 4)
    with ipuxl.Session(ir, "cpu") as session:
        assert session.transfers_per_run[data_in] == 8  # not 16: one branch of each runs
        with pytest.raises(ValueError, match="'data' is loaded 8 time"):
            session.run({data_in: np.zeros((4, 3), np.float32)})


def test_each_replica_transfers_in_the_branch_it_takes():
    ir = ipuxl.Ir(replication=2)
    spec = ipuxl.TensorSpec((3,), ipuxl.float32)
    with ir.main_graph:
        flag_in = ipuxl.h2d_stream((), ipuxl.bool, "flag")
        data_in = ipuxl.h2d_stream((3,), ipuxl.float32, "data")
        stored = ipuxl.d2h_stream((3,), ipuxl.float32, "stored")

        def then_fn(v):
            d = ops.host_load(data_in)
            ops.host_store(stored, d * 2.0)
            return v + d

        then_branch = ir.create_graph(then_fn, spec)
        else_branch = ir.create_graph(lambda v: v * 3.0, spec)
        v = ipuxl.variable(np.ones(3, np.float32), name="v")
        (out,) = ops.conditional(ops.host_load(flag_in), then_branch, else_branch, [v], [v])
        result = ipuxl.d2h_stream((3,), ipuxl.float32, "result")
        ops.host_store(result, out)
    data = np.arange(6, dtype=np.float32).reshape(2, 3)  # one slice per replica
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run({flag_in: np.array([True, False]), data_in: data})
    torch.testing.assert_close(torch.from_numpy(got[stored]), torch.tensor([[0.0, 2.0, 4.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(torch.from_numpy(got[result]), torch.tensor([[1.0, 2.0, 3.0], [3.0, 3.0, 3.0]]))
