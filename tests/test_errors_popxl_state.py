"""PopXL front-end mistakes about state and dtypes raise ``ipuxl.errors`` classes.

Three cases that used to give a raw Python/torch error, or none at all:

1. a variable, constant or stream of a dtype the IPU has no type for (complex...);
2. ``transforms.autodiff`` of a graph with no floating-point output or input;
3. an in-place op on a constant (or a view of one), which used to change the
   constant from run to run.

Each test checks the class, the builtin it also is, the name in the message, that
``where`` points at this file and that a fix is given.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl import transforms
from ipuxl.errors import AutodiffError, InvalidArgumentError

THIS_FILE = os.path.basename(__file__)


def _check(err: pytest.ExceptionInfo, builtin: type, *fragments: str) -> None:
    assert isinstance(err.value, builtin)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert err.value.where is not None and THIS_FILE in err.value.where, err.value.where
    assert err.value.fix


# -- 1. unsupported dtypes -------------------------------------------------------------------
@pytest.mark.parametrize("data", [np.zeros(3, np.complex64), torch.zeros(3, dtype=torch.complex64)],
                         ids=["numpy", "torch"])
def test_complex_variable_is_refused_with_its_name(data):
    ir = ipuxl.Ir()
    with ir.main_graph:
        with pytest.raises(InvalidArgumentError) as err:
            ipuxl.variable(data, name="cv")
    _check(err, TypeError, "variable 'cv'", "complex64", "not supported", "float32", "int32")
    assert "cv" in err.value.where
    assert "float32" in err.value.fix and "imag" in err.value.fix


def test_variable_with_complex_dtype_argument_is_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        with pytest.raises(InvalidArgumentError) as err:
            ipuxl.variable(np.zeros(3, np.float32), torch.complex64, name="cw")
    _check(err, TypeError, "variable 'cw'", "complex64", "not supported")


def test_complex_constant_is_refused_with_its_name():
    ir = ipuxl.Ir()
    with ir.main_graph:
        with pytest.raises(InvalidArgumentError) as err:
            ipuxl.constant(np.ones(2, np.complex128), name="cc")
    _check(err, TypeError, "constant 'cc'", "complex128", "not supported")


@pytest.mark.parametrize("dtype", [np.complex64, torch.complex64, "complex64"], ids=["numpy", "torch", "name"])
@pytest.mark.parametrize("make", [ipuxl.h2d_stream, ipuxl.d2h_stream], ids=["h2d", "d2h"])
def test_complex_stream_is_refused_with_its_name(make, dtype):
    ir = ipuxl.Ir()
    with ir.main_graph:
        with pytest.raises(InvalidArgumentError) as err:
            make((3,), dtype, "zs")
    _check(err, TypeError, "_stream 'zs'", "complex64", "not supported")
    assert ir.streams == []  # nothing half-made


def test_other_unsupported_host_dtypes_name_the_variable():
    ir = ipuxl.Ir()
    with ir.main_graph:
        with pytest.raises(InvalidArgumentError) as err:
            ipuxl.variable(np.zeros(3, np.uint64), name="big")
    _check(err, TypeError, "variable 'big'", "uint64", "not supported")
    with ir.main_graph:
        with pytest.raises(InvalidArgumentError) as err:
            ipuxl.h2d_stream((3,), "no_such_dtype", "s")
    _check(err, TypeError, "h2d_stream 's'", "unknown dtype name 'no_such_dtype'")


def test_supported_dtypes_still_work():
    ir = ipuxl.Ir()
    with ir.main_graph:
        assert ipuxl.variable(np.zeros(3, np.float64), name="w").dtype == ipuxl.float32  # downcast
        assert ipuxl.constant(np.zeros(3, np.int8)).dtype == ipuxl.int8
        assert ipuxl.h2d_stream((3,), np.float16, "x").dtype == ipuxl.float16
        assert ipuxl.d2h_stream((3,), "bfloat16", "y").dtype == ipuxl.bfloat16
        assert ipuxl.d2h_stream((3,), ipuxl.bool, "z").dtype == ipuxl.bool


# -- 2. autodiff with nothing to differentiate ---------------------------------------------------
def _graph(fn, *specs):
    ir = ipuxl.Ir()
    with ir.main_graph:
        return ir.create_graph(fn, *specs)


I32 = ipuxl.TensorSpec((3,), torch.int32)
F32 = ipuxl.TensorSpec((3,), torch.float32)


def test_autodiff_of_an_integer_graph_says_there_are_no_float_outputs():
    g = _graph(lambda a: a + 1, I32)
    with pytest.raises(AutodiffError) as err:
        transforms.autodiff(g)
    _check(err, ValueError, f"graph '{g.name}'", "no floating-point outputs")
    assert g.name in err.value.where
    assert "cast" in err.value.fix


def test_autodiff_of_a_graph_with_integer_outputs_only():
    g = _graph(lambda a: ops.cast(a * 2, ipuxl.int32), F32)
    with pytest.raises(AutodiffError) as err:
        transforms.autodiff(g)
    _check(err, ValueError, f"graph '{g.name}'", "no floating-point outputs", "int32")


def test_autodiff_of_a_graph_with_integer_inputs_only():
    g = _graph(lambda a: ops.cast(a, ipuxl.float32) * 2, I32)
    with pytest.raises(AutodiffError) as err:
        transforms.autodiff(g)
    _check(err, ValueError, f"graph '{g.name}'", "no floating-point inputs", "'a' (int32)")


@pytest.mark.parametrize("pick", [lambda g: [], lambda g: [g.outputs[1]]], ids=["empty", "int-only"])
def test_autodiff_grads_provided_without_a_float_output(pick):
    g = _graph(lambda a: (a * 2, ops.cast(a, ipuxl.int32)), F32)
    with pytest.raises(AutodiffError) as err:
        transforms.autodiff(g, grads_provided=pick(g))
    _check(err, ValueError, f"graph '{g.name}'", "grads_provided holds no floating-point output")


def test_autodiff_is_refused_before_tracing(monkeypatch):
    import ipuxl.passes.autodiff as pass_module

    def no_trace(*args, **kwargs):
        raise AssertionError("traced")

    monkeypatch.setattr(pass_module, "_trace_joint", no_trace)
    g = _graph(lambda a: a + 1, I32)
    with pytest.raises(AutodiffError):
        transforms.autodiff(g)


def test_autodiff_of_mixed_int_and_float_inputs_still_works():
    g = _graph(lambda a, b: a * ops.cast(b, ipuxl.float32), F32, I32)
    info = transforms.autodiff(g)
    assert [t.name for t in info.outputs] == ["a"]


# -- 3. in-place ops on constants --------------------------------------------------------------
def test_inplace_op_on_a_constant_is_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        c = ipuxl.constant(np.zeros(3, np.float32), name="c")
        one = ipuxl.constant(np.ones(3, np.float32), name="one")
        before = len(ir.main_graph.fx.nodes)
        with pytest.raises(InvalidArgumentError) as err:
            ops.scaled_add_(c, one)
    _check(err, TypeError, "'scaled_add_'", "constant 'c'", "never change")
    assert "constant 'c'" in err.value.where
    assert "ipuxl.variable" in err.value.fix and "ops.scaled_add " in err.value.fix
    assert len(ir.main_graph.fx.nodes) == before  # no half-built op


def test_inplace_op_on_a_view_of_a_constant_is_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        c = ipuxl.constant(np.zeros(3, np.float32), name="c")
        with pytest.raises(InvalidArgumentError) as err:
            ops.add_(ops.reshape(c, (3, 1)), 1.0)
    _check(err, TypeError, "'add_'", "a view of constant 'c'")
    assert "ops.add " in err.value.fix


def test_var_update_on_a_constant_in_a_subgraph_is_refused():
    ir = ipuxl.Ir()

    def body(x):
        k = ipuxl.constant(np.zeros(3, np.float32), name="k")
        ops.var_updates.accumulate_(k, x)
        return k

    with ir.main_graph:
        with pytest.raises(InvalidArgumentError) as err:
            ir.create_graph(body, F32)
    _check(err, TypeError, "'accumulate_'", "constant 'k'")


def test_constant_passed_by_reference_to_a_graph_that_writes_it_is_refused():
    ir = ipuxl.Ir()

    def increment(t):
        ops.scaled_add_(t, ipuxl.constant(np.ones(3, np.float32)))

    with ir.main_graph:
        c = ipuxl.constant(np.zeros(3, np.float32), name="c")
        graph = ir.create_graph(increment, ipuxl.TensorByRef(c))
        with pytest.raises(InvalidArgumentError) as err:
            ops.call(graph, c)
        reader = ir.create_graph(lambda t: t * 2.0, ipuxl.TensorByRef(c))
        ops.call(reader, c)  # passing a constant by reference to a graph that only reads it is fine
    _check(err, TypeError, "constant 'c'", "never change")


def test_inplace_op_on_a_variable_still_runs():
    w0 = np.arange(3, dtype=np.float32)
    ir = ipuxl.Ir()
    with ir.main_graph, ipuxl.in_sequence():
        w = ipuxl.variable(w0, name="w")
        d = ipuxl.constant(np.full(3, 0.5, np.float32), name="d")
        ops.scaled_add_(w, d, a=2.0, b=-1.0)  # w = 2 w - d
        ops.add_(w, d)                        # w = w + d
        stream = ipuxl.d2h_stream((3,), ipuxl.float32, "w_out")
        ops.host_store(stream, w + 0)
    ir.num_host_transfers = 1
    expected = w0.copy()
    with ipuxl.Session(ir, "ipu_model") as session:
        for _ in range(3):
            expected = (2 * expected - 0.5) + 0.5
            np.testing.assert_allclose(session.run()[stream], expected)
        np.testing.assert_allclose(session.get_tensor_data(d), np.full(3, 0.5, np.float32))
