"""Tensors (``ipuxl.ir.tensor``): values at build time, the methods and operators PopXL's ``Tensor``
has (against torch), strides, specs, length and truth, and a variable's replica grouping."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl import errors
from ipuxl.errors import UndefinedValue

from tests._run import run


# -- tensors' values at build time -------------------------------------------------------------
def test_reading_a_tensor_without_data_raises_undefined_value():
    with ipuxl.Ir().main_graph:
        c = ipuxl.constant(np.array([[1, 2], [3, 4]], np.int32), name="c")
        y = c * 2
        np.testing.assert_array_equal(np.asarray(c), [[1, 2], [3, 4]])
        with pytest.raises(UndefinedValue, match="'mul'.*has no value") as info:
            np.asarray(y)
    assert "host_store" in info.value.fix


# -- Tensor methods and operators ----------------------------------------------------------
A = np.array([[5.5, -7.0, 3.0], [-4.5, 2.0, 9.0]], np.float32)
B = np.array([[2.0, 3.0, -2.5], [2.0, -1.5, 4.0]], np.float32)


def test_operators_mod_rmod_rand_ror_match_torch():
    def build():
        a, b = ipuxl.constant(A), ipuxl.constant(B)
        m = ipuxl.constant(np.array([True, False, True]))
        return {"mod": a % b, "rmod": 7.0 % a, "rand": True & m, "ror": False | m,
                "rmod_np": np.float32(3.0) % b}

    out = run(build)
    a, b, m = torch.from_numpy(A), torch.from_numpy(B), torch.tensor([True, False, True])
    torch.testing.assert_close(torch.from_numpy(out["mod"]), torch.fmod(a, b))
    torch.testing.assert_close(torch.from_numpy(out["rmod"]), torch.fmod(torch.tensor(7.0), a))
    torch.testing.assert_close(torch.from_numpy(out["rmod_np"]), torch.fmod(torch.tensor(3.0), b))
    torch.testing.assert_close(torch.from_numpy(out["rand"]), m & True)
    torch.testing.assert_close(torch.from_numpy(out["ror"]), m | False)


def test_in_place_methods_match_torch_and_alias_their_input():
    def build():
        w = ipuxl.variable(A, name="w")
        r = w.reshape_((3, 2))
        t = ipuxl.variable(A, name="t").transpose_((1, 0))
        tt = ipuxl.variable(A, name="tt").T_
        f = ipuxl.variable(A, name="f").flatten_()
        d = ipuxl.variable(A, name="d").detach_()
        acc = ipuxl.variable(A, name="acc")
        acc += ipuxl.constant(B)
        ops.scaled_add_(r, ipuxl.constant(np.ones((3, 2), np.float32)), b=10.0)  # writes w through the view
        return {"t": t, "tt": tt, "f": f, "d": d, "w": w, "acc": acc}

    out = run(build)
    a = torch.from_numpy(A)
    torch.testing.assert_close(torch.from_numpy(out["t"]), a.T)
    torch.testing.assert_close(torch.from_numpy(out["tt"]), a.T)
    torch.testing.assert_close(torch.from_numpy(out["f"]), a.flatten())
    torch.testing.assert_close(torch.from_numpy(out["d"]), a)
    torch.testing.assert_close(torch.from_numpy(out["acc"]), a + torch.from_numpy(B))
    torch.testing.assert_close(torch.from_numpy(out["w"]), a + 10.0)


def test_strides_match_numpys():
    with ipuxl.Ir().main_graph:
        x = ipuxl.constant(np.zeros((2, 3, 4), np.float16))
    assert x.strides() == np.zeros((2, 3, 4), np.float16).strides
    assert x.strides((5, 6)) == np.zeros((5, 6), np.float16).strides


def test_tensors_do_not_iterate_and_numpy_defers_to_them():
    with ipuxl.Ir().main_graph:
        x = ipuxl.constant(A)
        with pytest.raises(TypeError):
            iter(x)
        product = np.ones((3, 3), np.float32) @ x.T  # numpy defers to Tensor.__rmatmul__
    assert isinstance(product, ipuxl.Tensor) and product.shape == (3, 2)


def test_variable_grouping_properties():
    ir = ipuxl.Ir(replication=4)
    with ir.main_graph:
        rg = ir.replica_grouping(group_size=2)
        v = ipuxl.variable(np.zeros((2, 3), np.float32), replica_grouping=rg, retrieval_mode="all_replicas")
        plain = ipuxl.variable(np.zeros(3, np.float32))
    assert v.replica_grouping == rg and v.retrieval_mode == "all_replicas"
    assert v.shape_on_replica == (3,) and v.shape_on_host == (2, 3)
    assert plain.replica_grouping == ir.replica_grouping() and plain.retrieval_mode == "one_per_group"
    assert plain.shape_on_host == plain.shape_on_replica == (3,)


def test_tensor_spec_is_a_mapping_like_popxls():
    ir = ipuxl.Ir()
    with ir.main_graph:
        spec = ipuxl.constant(np.zeros((2, 3), np.float16)).spec
        assert dict(spec) == {"shape": (2, 3), "dtype": ipuxl.float16, "meta_shape": ()}
        assert len(spec) == 3 and spec["dtype"] is ipuxl.float16
        graph = ir.create_graph(lambda: ipuxl.graph_input(**spec, name="y") * 2.0)  # PopXL unpacks specs so
    (y,) = graph.inputs
    assert (y.name, y.shape, y.dtype) == ("y", (2, 3), ipuxl.float16)


def test_len_and_truth_of_tensors():
    with ipuxl.Ir().main_graph:
        x, s = ipuxl.constant(np.zeros((4, 2), np.float32)), ipuxl.constant(1.0)
        assert len(x) == 4
        with pytest.raises(errors.InvalidValueError, match="scalar tensor") as info:
            len(s)
        assert isinstance(info.value, ValueError)
        with pytest.raises(errors.InvalidArgumentError, match="truth value") as info2:
            bool(x)
        assert isinstance(info2.value, TypeError)
        with pytest.raises(TypeError, match="in_sequence"):
            ipuxl.in_sequence(None)


def test_numpy_scalars_are_numbers_in_ops():
    """``x * np.float32(2)`` as PopXL takes it (the generated code once named ``np`` and failed)."""
    import ipuxl
    import ipuxl.ops as ops

    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.full(3, 3.0, np.float32))
        y = ipuxl.variable(np.ones(3, np.float32))
        outs = [x * np.float32(2), x ** np.int64(2), ops.scaled_add(x, y, np.float32(0.5), np.float64(2.0))]
        streams = [ipuxl.d2h_stream(o.shape, o.dtype) for o in outs]
        for stream, out in zip(streams, outs):
            ops.host_store(stream, out)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run()
    for stream, want in zip(streams, ([6.0] * 3, [9.0] * 3, [3.5] * 3)):
        np.testing.assert_array_equal(got[stream], np.array(want, np.float32))
        assert got[stream].dtype == np.float32
