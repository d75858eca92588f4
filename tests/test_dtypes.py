"""PopXL's dtype objects: names, attributes, conversions, and dtypes flowing through graphs.

Oracles: numpy's and torch's own dtype attributes, and eager torch for values.
"""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl import dtypes
from ipuxl.errors import DtypeError, InvalidArgumentError

from tests._run import run

# PopXL name -> (torch dtype, numpy dtype or None)
TABLE = {
    "bool": (torch.bool, np.bool_), "int8": (torch.int8, np.int8), "int16": (torch.int16, np.int16),
    "int32": (torch.int32, np.int32), "int64": (torch.int64, np.int64), "uint8": (torch.uint8, np.uint8),
    "uint16": (torch.uint16, np.uint16), "uint32": (torch.uint32, np.uint32), "uint64": (torch.uint64, np.uint64),
    "float16": (torch.float16, np.float16), "bfloat16": (torch.bfloat16, None),
    "float32": (torch.float32, np.float32), "float64": (torch.float64, np.float64),
    "complex64": (torch.complex64, np.complex64), "complex128": (torch.complex128, np.complex128),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_dtype_matches_torch_and_numpy(name):
    torch_dtype, numpy_dtype = TABLE[name]
    d = getattr(ipuxl, name)
    assert isinstance(d, ipuxl.dtype) and d is getattr(dtypes, name)
    assert d.name == name and repr(d) == f"ipuxl.dtypes.{name}"
    assert d.as_torch() is torch_dtype
    assert d == torch_dtype and torch_dtype == d and hash(d) == hash(torch_dtype)
    assert d.is_floating_point == torch_dtype.is_floating_point
    assert d.is_complex == torch_dtype.is_complex
    assert d.is_signed == torch_dtype.is_signed
    assert d.itemsize == torch.empty((), dtype=torch_dtype).element_size()
    if numpy_dtype is None:
        return
    assert d.as_numpy() == np.dtype(numpy_dtype)
    assert d.is_int == np.issubdtype(numpy_dtype, np.integer)
    assert d.itemsize == np.dtype(numpy_dtype).itemsize
    assert dtypes.dtype.as_dtype(np.dtype(numpy_dtype)) is d
    assert dtypes.dtype.as_dtype(numpy_dtype) is d
    assert dtypes.dtype.as_dtype(np.zeros(2, numpy_dtype)) is d


@pytest.mark.parametrize("alias, target", [("half", "float16"), ("float", "float32"), ("double", "float64")])
def test_popxl_aliases_are_the_same_objects(alias, target):
    assert getattr(ipuxl, alias) is getattr(ipuxl, target) is getattr(dtypes, alias)
    assert ipuxl.dtype.from_name(alias) is getattr(ipuxl, target)
    assert ipuxl.dtype.as_dtype(alias) is getattr(ipuxl, target)


@pytest.mark.parametrize("value, expected", [
    (torch.float16, "float16"), ("int32", "int32"), (bool, "bool"), (float, "float32"),
    (torch.zeros(2, dtype=torch.int8), "int8"), (np.ones(3), "float64"), (ipuxl.uint8, "uint8"),
])
def test_as_dtype_accepts_popxl_torch_numpy_python_and_arrays(value, expected):
    assert ipuxl.dtype.as_dtype(value) is getattr(ipuxl, expected)


@pytest.mark.parametrize("bad", ["float128x", object(), np.dtype("U3")])
def test_as_dtype_of_nothing_known_is_a_value_error(bad):
    with pytest.raises(DtypeError, match="no ipuxl dtype") as info:
        ipuxl.dtype.as_dtype(bad)
    assert isinstance(info.value, ValueError)
    assert "float32" in info.value.fix


def test_from_name_of_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="'nope'"):
        ipuxl.dtype.from_name("nope")


def test_dtype_cannot_be_instantiated():
    with pytest.raises(TypeError, match="as_dtype"):
        ipuxl.dtype()


def test_bfloat16_has_no_numpy_dtype():
    with pytest.raises(TypeError, match="bfloat16 has no numpy dtype"):
        ipuxl.bfloat16.as_numpy()


def test_equality_is_by_dtype_not_by_accident():
    assert ipuxl.float32 != ipuxl.float16 and ipuxl.float32 != torch.float16
    assert ipuxl.float32 != np.float32 and ipuxl.float32 != "float32"
    assert {torch.float32: "a"}[ipuxl.float32] == "a"
    assert {ipuxl.int32: "b"}[torch.int32] == "b"
    assert ipuxl.float16 in (torch.float16,) and torch.float16 in (ipuxl.float16,)


def test_pickle_and_deepcopy_keep_the_module_instance():
    assert pickle.loads(pickle.dumps(ipuxl.float16)) is ipuxl.float16
    assert copy.deepcopy({"d": ipuxl.int8})["d"] is ipuxl.int8


def test_tensors_streams_and_specs_show_popxl_dtypes():
    ir = ipuxl.Ir()
    with ir.main_graph:
        s = ipuxl.h2d_stream((2, 3), ipuxl.float16, "s")
        x = ops.host_load(s)
        w = ipuxl.variable(np.ones((3,), np.int64), name="w")  # downcast to int32
        y = ops.cast(x, torch.float32) + 1.0
    assert s.dtype is ipuxl.float16 and s.dtype.as_numpy() == np.float16
    assert x.dtype is ipuxl.float16 and w.dtype is ipuxl.int32 and y.dtype is ipuxl.float32
    assert x.spec.dtype is torch.float16  # internals keep torch dtypes
    assert x.spec.to_dict()["dtype"] is ipuxl.float16
    assert x.spec.to_tuple() == ((2, 3), ipuxl.float16, ())


@pytest.mark.parametrize("given", [ipuxl.float16, torch.float16, np.float16, "float16", "half"])
def test_every_dtype_argument_takes_popxl_torch_numpy_or_a_name(given):
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable([1.5, 2.5], dtype=given)
        c = ipuxl.constant(3, dtype=given)
        s = ipuxl.h2d_stream((2,), given, "s")
        cast = ops.cast(v, given)
        spec = ipuxl.TensorSpec((2,), given)
        graph = ir.create_graph(lambda a: a * 2.0, spec)
    for t in (v, c, cast, graph.inputs[0]):
        assert t.dtype is ipuxl.float16
    assert s.dtype is ipuxl.float16 and spec.dtype is torch.float16


def test_user_guide_host_data_from_stream_dtype_as_numpy():
    """``np.zeros(stream.shape, stream.dtype.as_numpy())``, as the user guide builds host data."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2, 2), ipuxl.int32, "x")
        y_stream = ipuxl.d2h_stream((2, 2), ipuxl.int32, "y")
        ops.host_store(y_stream, ops.host_load(x_stream) * 3)
    data = np.arange(4, dtype=x_stream.dtype.as_numpy()).reshape(x_stream.shape)
    with ipuxl.Session(ir, "cpu") as session:
        y = session.run({x_stream: data})[y_stream]
    assert y.dtype == y_stream.dtype.as_numpy()
    torch.testing.assert_close(torch.from_numpy(y), torch.from_numpy(data) * 3)


def test_a_dtype_passed_to_create_graph_is_a_plain_argument():
    def convert(x, to):
        return ops.cast(x, to) * 2

    out = run(lambda: {"y": ops.call(ipuxl.gcg().ir.create_graph(convert, ipuxl.constant([1.5, -2.5]),
                                                                 ipuxl.int32), ipuxl.constant([1.5, -2.5]))[0]})
    expected = torch.tensor([1.5, -2.5]).to(torch.int32) * 2
    torch.testing.assert_close(torch.from_numpy(out["y"]), expected)


@pytest.mark.parametrize("dtype", [ipuxl.complex64, ipuxl.uint64])
def test_dtypes_without_ipu_support_are_refused_for_streams(dtype):
    ir = ipuxl.Ir()
    with ir.main_graph:
        with pytest.raises(InvalidArgumentError, match=f"dtype {dtype.name} is not supported") as info:
            ipuxl.h2d_stream((2,), dtype, "bad")
    assert isinstance(info.value, TypeError)
