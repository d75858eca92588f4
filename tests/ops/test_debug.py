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
