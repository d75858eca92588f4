"""The debug ops (``ipuxl.ops.debug``: ``init``, ``print_tensor``): fresh values on every call,
printing at run time, and the gradient's print."""
from __future__ import annotations

import numpy as np
import pytest

import ipuxl
import ipuxl.ops as ops

from ._harness import randn, run_main, run_op


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


def test_print_tensor_prints_at_run_time_to_stderr_and_returns_its_input(capfd):
    x0 = np.array([[1.5, -2.0]])

    def build(ir, load):
        y = ops.print_tensor(load("x"), "my x")
        return {"y": y * 2}

    capfd.readouterr()
    got = run_main(build, {"x": x0})
    np.testing.assert_allclose(got["y"], 2 * x0)
    printed = capfd.readouterr()
    # Poplar's layout with PopXL's defaults (8 digits, " " separator, square brackets), on stderr
    assert "my x: [\n [ 1.5000000 -2.0000000]\n]" in printed.err and "my x" not in printed.out


def test_print_tensor_format_options_and_default_title(capfd):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.arange(8, dtype=np.float32), name="x")
        y = ops.print_tensor(x, summarise_threshold=4, edge_items=1, digits=2, float_format="fixed",
                             separator=", ", open_bracket="|", close_bracket="|")
        out = ipuxl.d2h_stream(y.shape, y.dtype, "out")
        ops.host_store(out, y)
    capfd.readouterr()
    with ipuxl.Session(ir, "ipu_model") as session:
        np.testing.assert_array_equal(session.run()[out], np.arange(8, dtype=np.float32))
    assert "print_x: |0.0, ..., 7.0|" in capfd.readouterr().err
    with ir.main_graph, pytest.raises(ValueError, match="float_format must be one of"):
        ops.print_tensor(x, float_format="engineering")


def test_print_tensor_prints_the_gradient(capfd):
    x0 = np.array([1.0, 2.0, 3.0])
    capfd.readouterr()
    got = run_op(lambda x: ops.print_tensor(x, "t", print_self=False, print_gradient=True) * 3.0, [x0])
    err = capfd.readouterr().err
    dy = got["dy"][0][1]
    assert "t_gradient: [" in err
    printed = [float(v) for v in err.split("t_gradient: [")[1].split("]")[0].split()]
    np.testing.assert_allclose(printed, dy * 3.0, rtol=1e-6)
    assert not any(line.startswith("t: ") for line in err.splitlines())  # print_self=False
    np.testing.assert_allclose(got["grad"][0], 3.0 * dy)


def test_print_tensor_with_print_self_can_be_differentiated(capfd):
    """PopXL's print op has a grad op: a graph that prints itself and its gradient differentiates."""
    x0 = np.array([0.5, -1.0])
    capfd.readouterr()
    got = run_op(lambda x: ops.print_tensor(x, "both", print_gradient=True) * 2.0, [x0])
    err = capfd.readouterr().err
    assert "both: [" in err and "both_gradient: [" in err
    np.testing.assert_allclose(got["grad"][0], 2.0 * got["dy"][0][1])
