"""PopXL's module-level names, ``popxl.tensor``/``popxl.utils``, Graph properties and hooks,
name scopes, ``graph_output``, ``CallSiteInfo`` index maps and the Tensor methods."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl import errors, utils
from ipuxl.errors import CallIndexError, CallInputError, GraphContextError, UndefinedValue, WrongGraphError

from tests._run import run


# -- popxl.tensor and popxl.utils -----------------------------------------------------------
def test_tensor_module_has_what_popxl_tensor_exports():
    from ipuxl.tensor import Constant, TensorByRef, Variable, graph_input, graph_output  # noqa: F401

    assert ipuxl.tensor.Variable is ipuxl.Variable and ipuxl.tensor.graph_input is ipuxl.graph_input
    assert graph_output is ipuxl.graph_output and Constant is ipuxl.Constant
    for alias in ("HostTensor", "HostScalarTensor", "TensorLike", "ScalarType"):
        assert hasattr(ipuxl.tensor, alias)


@pytest.mark.parametrize("data, kwargs, expected", [
    ([1.5, 2.5], {}, np.float32),
    (np.arange(3, dtype=np.int64), {}, np.int32),
    (np.arange(3, dtype=np.uint64), {}, np.uint32),
    (np.arange(3, dtype=np.int64), {"downcast": False}, np.int64),
    ([1, 2], {"dtype": ipuxl.float16}, np.float16),
    (torch.arange(4, dtype=torch.int16), {}, np.int16),
    (torch.ones(2, dtype=torch.bfloat16), {}, np.float32),
    (np.ones(2, np.float64), {"dtype": torch.float64}, np.float64),
])
def test_to_numpy_matches_numpy_with_popxl_downcasting(data, kwargs, expected):
    out = utils.to_numpy(data, **kwargs)
    source = data.float().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    assert out.dtype == np.dtype(expected) and out.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(out, source.astype(expected))


def test_to_numpy_copies_unless_told_not_to():
    data = np.arange(4, dtype=np.float32)
    assert not np.shares_memory(utils.to_numpy(data), data)
    assert utils.to_numpy(data, copy=False) is data


def test_to_numpy_refuses_float8_options():
    with pytest.raises(errors.UnsupportedError, match="log2_scale") as info:
        utils.to_numpy([1.0], log2_scale=2)
    assert isinstance(info.value, RuntimeError)


def test_variable_takes_popxls_arguments_and_no_others():
    import ipuxl

    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        with pytest.raises(errors.UnsupportedError, match="nan_on_overflow"):
            ipuxl.variable([1.0], nan_on_overflow=True)
        with pytest.raises(TypeError, match="unexpected keyword argument 'grouping'"):  # PopXL's is replica_grouping
            ipuxl.variable(np.zeros((2, 3), np.float32), grouping=ir.replica_grouping(group_size=1))
        v = ipuxl.variable(np.zeros((2, 3), np.float32), replica_grouping=ir.replica_grouping(group_size=1),
                           log2_scale=None, nan_on_overflow=None)
    assert v.shape == (3,)


def test_downcast_table_is_popxls():
    assert utils.downcast_np_dtypes == {np.dtype("int64"): np.dtype("int32"),
                                        np.dtype("uint64"): np.dtype("uint32"),
                                        np.dtype("float64"): np.dtype("float32")}


# -- tensors' values at build time -------------------------------------------------------------
def test_reading_a_tensor_without_data_raises_undefined_value():
    with ipuxl.Ir().main_graph:
        c = ipuxl.constant(np.array([[1, 2], [3, 4]], np.int32), name="c")
        y = c * 2
        np.testing.assert_array_equal(np.asarray(c), [[1, 2], [3, 4]])
        with pytest.raises(UndefinedValue, match="'mul'.*has no value") as info:
            np.asarray(y)
    assert "host_store" in info.value.fix


# -- context functions --------------------------------------------------------------------------
def test_gmg_gir_return_the_main_graph_and_ir_while_building_a_subgraph():
    ir = ipuxl.Ir()
    seen = {}

    def body(x):
        seen.update(main=ipuxl.gmg(), main2=ipuxl.get_main_graph(), ir=ipuxl.gir(), ir2=ipuxl.get_ir())
        return x + 1

    with ir.main_graph:
        ir.create_graph(body, ipuxl.TensorSpec((2,), ipuxl.float32))
    assert seen["main"] is seen["main2"] is ir.main_graph and seen["ir"] is seen["ir2"] is ir


def test_gmg_outside_any_graph_is_a_graph_context_error():
    with pytest.raises(GraphContextError, match="no graph is being built") as info:
        ipuxl.gmg()
    assert isinstance(info.value, RuntimeError)


def test_name_scope_prefixes_names_and_nests():
    with ipuxl.Ir().main_graph:
        with ipuxl.name_scope("block") as scopes:
            assert scopes == ["block"]
            w = ipuxl.variable([1.0], name="w")
            with ipuxl.name_scope("inner"):
                y = ops.mul(w, 2.0)
            z = ops.add(y, 1.0, )
        after = ops.add(z, 1.0)
    assert w.name == "block/w" and y.name == "block/inner/mul" and z.name == "block/add"
    assert "block" not in after.name


# -- graph_output and create_graph outputs -------------------------------------------------
def test_graph_output_marks_outputs_of_a_function_returning_none():
    def body(x):
        y = x * 3.0
        ipuxl.graph_output(y)
        ipuxl.graph_output(x - 1.0)

    data = np.array([1.0, -2.0], np.float32)

    def build():
        g = ipuxl.gcg().ir.create_graph(body, ipuxl.TensorSpec((2,), ipuxl.float32))
        assert len(g.outputs) == 2
        a, b = ops.call(g, ipuxl.constant(data))
        return {"a": a, "b": b}

    out = run(build)
    torch.testing.assert_close(torch.from_numpy(out["a"]), torch.from_numpy(data) * 3.0)
    torch.testing.assert_close(torch.from_numpy(out["b"]), torch.from_numpy(data) - 1.0)


def test_graph_output_of_another_graphs_tensor_is_a_value_error():
    ir = ipuxl.Ir()
    with ir.main_graph:
        outer = ipuxl.constant([1.0])
        with pytest.raises(WrongGraphError, match="graph_output of tensor") as info:
            ir.create_graph(lambda x: ipuxl.graph_output(outer), ipuxl.TensorSpec((1,), ipuxl.float32))
    assert isinstance(info.value, ValueError)


# -- Graph properties and hooks -------------------------------------------------------------
def test_graph_tensors_variables_constants_inputs_outputs_and_id():
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.ones(2, np.float32), name="w")
        c = ipuxl.constant([2.0, 3.0], name="c")
        y = w * c
        g = ir.create_graph(lambda a, b: a + b, ipuxl.TensorSpec((2,), ipuxl.float32), ipuxl.TensorSpec((2,),
                                                                                                     ipuxl.float32))
    main = ir.main_graph
    assert main.tensors == (w, c, y)
    assert main.variables == (w,) and isinstance(main.variables[0], ipuxl.Variable)
    assert tuple(main.constants) == (c,) and isinstance(main.constants[0], ipuxl.Constant)
    assert g.variables == () and g.constants == ()
    assert g.inputs_by_name == {"a": g.inputs[0], "b": g.inputs[1]} and len(g.outputs) == 1
    assert g.id == g.name and g.name.endswith("_subgraph(0)") and main.id == "main_graph"
    assert g.main_graph is main and main.get_tensor("main_graph/w") is w and main.get_tensor("c") is c
    assert w in main and w not in g
    with pytest.raises(ValueError, match="no tensor with id 'nope'"):
        main.get_tensor("nope")
    with pytest.raises(TypeError, match="needs a Tensor"):
        _ = 3 in main


def test_op_created_hook_sees_each_op_of_its_graph_only():
    ir = ipuxl.Ir()
    built: list[str] = []
    handle = ir.main_graph.register_op_created_hook(lambda node: built.append(node.meta["ipuxl_op"]))
    with ir.main_graph:
        x = ipuxl.constant([1.0, 2.0])
        y = ops.relu(x * 2.0)
        ir.create_graph(lambda a: ops.exp(a), ipuxl.TensorSpec((2,), ipuxl.float32))  # another graph
        ir.main_graph.remove_op_created_hook(handle)
        ops.neg(y) if hasattr(ops, "neg") else ops.negate(y)
    assert built == ["mul", "relu"]
    with pytest.raises(ValueError, match=f"unknown op created hook {handle}"):
        ir.main_graph.remove_op_created_hook(handle)


# -- CallSiteInfo -------------------------------------------------------------------------------
def test_call_site_info_index_maps_and_tensor_maps():
    ir = ipuxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a, b: (a + b, a * b), *[ipuxl.TensorSpec((2,), ipuxl.float32)] * 2)
        x, y = ipuxl.constant([1.0, 2.0]), ipuxl.constant([3.0, 4.0])
        info = ops.call_with_info(g, x, y)
    for i in range(2):
        assert info.graph_to_parent_input_index(i) == i == info.parent_to_graph_input_index(i)
        assert info.graph_to_parent_output_index(i) == i == info.parent_to_graph_output_index(i)
        assert info.parent_input(info.graph_to_parent_input_index(i)) is (x, y)[i]
        assert info.graph_to_parent(g.outputs[i]) is info.outputs[i]
    assert info.parent_to_graph(y) is g.inputs[1]
    with pytest.raises(CallIndexError, match="graph input index 2 is out of range") as exc:
        info.graph_to_parent_input_index(2)
    assert isinstance(exc.value, IndexError)
    with pytest.raises(IndexError):
        info.parent_to_graph_output_index(-1)
    with pytest.raises(CallInputError, match="not a parent input"):
        info.parent_to_graph(info.outputs[0])
    with pytest.raises(ValueError, match="not an input or output of the called graph"):
        info.graph_to_parent(x)


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
