"""PopXL's graph-building surface as upstream has it: names, ids, placement queries, argument checks.

Each test pins one behaviour of PopXL 3.x that programs (and PopXL's own tests) rely on:
what an unnamed tensor is called, what ``Tensor.id`` and ``repr`` look like, which
errors ``create_graph`` raises, where tensors are placed, which streams an IR uses.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl import errors, testing
from ipuxl.dtypes import _NP_TO_POPXL, _PT_TO_POPXL
from ipuxl.ops import random as random_ops
from ipuxl.ops.utils import check_in_graph, check_tensor_ipu_and_tile_set


def test_unnamed_variables_and_constants_are_called_t_and_names_stay_unique():
    ir = ipuxl.Ir()
    with ir.main_graph:
        first, second = ipuxl.variable(1), ipuxl.constant(2)
        named = [ipuxl.variable(1, name="w"), ipuxl.variable(1, name="w"), ipuxl.constant(1, name="w")]
    assert first.name == "t" and second.name != "t"
    assert named[0].name == "w" and len({t.name for t in named}) == 3


def test_main_graph_ids_are_names_and_subgraph_ids_are_scoped_by_the_qualified_graph_name():
    ir = ipuxl.Ir()

    def body(a):
        return a + a

    with ir.main_graph:
        a = ipuxl.variable([1], name="bob")
        graph = ir.create_graph(body, a)
    qualified = "test_main_graph_ids_are_names_and_subgraph_ids_are_scoped_by_the_qualified_graph_name.body"
    assert a.id == "bob" and repr(a) == "Tensor[bob ipuxl.dtypes.int32 (1,)]"
    assert graph.name == f"{qualified}_subgraph(0)"  # PopXL drops '.<locals>' and keeps the dots
    assert graph.inputs[0].id == f"{qualified}_subgraph(0)/a"
    assert ir.main_graph.get_tensor("bob") is a and ir.main_graph.get_tensor("main_graph/bob") is a


def test_create_graph_argument_errors_are_upstreams_types():
    ir = ipuxl.Ir()

    def three(x, y, c: int):
        return x * c + y

    with ir.main_graph:
        v = ipuxl.variable(1)
        with pytest.raises(ValueError, match="do not match the signature"):
            ir.create_graph(three, v, 5)
        with pytest.raises(TypeError, match="can't contain a mixture of Tensors and other types"):
            ir.create_graph(lambda *xs: None, v, 5)
        with pytest.raises(TypeError, match="mixture"):
            ir.create_graph(lambda xs: None, [5, v])
        for returned in (True, [True, True]):
            with pytest.raises(ValueError, match="Output of subgraph must be None, a Tensor or an iterable"):
                ir.create_graph(lambda: returned)


def test_by_ref_inputs_are_listed_as_popxl_names_them():
    ir = ipuxl.Ir()

    def foo(x: ipuxl.TensorByRef, y: ipuxl.Tensor, c: int):
        return (x * c) + y

    with ir.main_graph:
        v1, v2 = ipuxl.variable(1), ipuxl.variable(2)
        graph = ir.create_graph(foo, v1, v2, 5)
    assert graph._by_ref_inputs == {graph.inputs[0]} and graph.inputs[0].name == "x"


def test_tensor_ipu_and_tile_set():
    ir = ipuxl.Ir()
    with ir.main_graph:
        v = ipuxl.variable(1)
        on_0 = v + 0
        with ipuxl.ipu(1):
            on_1 = ipuxl.variable(1) + 0
        with ipuxl.io_tiles():
            on_io = ipuxl.variable(1) + 0
        with ipuxl.ipu(None):
            nowhere = v + 0
    assert (on_0.ipu, on_1.ipu, on_0.tile_set, on_io.tile_set) == (0, 1, "compute", "io")
    for tensor, what in ((v, "ipu"), (v, "tile_set"), (nowhere, "ipu")):
        with pytest.raises(errors.UndefinedValue, match="undefined"):
            getattr(tensor, what)
    with ir.main_graph, pytest.raises(ValueError, match="tile sets differ"):
        on_0 + on_io
    with pytest.raises(ValueError, match="IPUs: .*t2"):
        check_tensor_ipu_and_tile_set(t1=on_0, t2=on_1)
    with pytest.raises(ValueError, match="tile sets: .*t3"):
        check_tensor_ipu_and_tile_set(t1=on_0, t2=v, t3=on_io)
    check_tensor_ipu_and_tile_set(t1=on_0, t2=v)  # a variable has neither: it does not conflict
    check_in_graph(ir.main_graph, a=on_0)
    sub = ir.create_empty_graph()
    with pytest.raises(ValueError, match="not in the graph"):
        check_in_graph(sub, a=on_0)


def test_indexing_with_host_data_gathers_or_masks():
    data = np.arange(8, dtype=np.float32).reshape(4, 2)
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(data)
        gathered, masked = x[[2, 0]], x[np.array([[True], [False], [True], [False]])]
        outs = [ipuxl.d2h_stream(t.shape, t.dtype) for t in (gathered, masked)]
        for stream, t in zip(outs, (gathered, masked)):
            ops.host_store(stream, t)
    with ipuxl.Session(ir, "cpu") as session:
        result = session.run()
    assert_close(torch.from_numpy(result[outs[0]]), torch.from_numpy(data[[2, 0]]))
    assert_close(torch.from_numpy(result[outs[1]]), torch.from_numpy(data * np.array([[1], [0], [1], [0]], np.float32)))


def test_get_all_streams_lists_only_streams_the_program_uses():
    ir = ipuxl.Ir()
    with ir.main_graph:
        used_in, unused_in = ipuxl.h2d_stream((), ipuxl.float32), ipuxl.h2d_stream((), ipuxl.float32)
        used_out, unused_out = ipuxl.d2h_stream((), ipuxl.float32), ipuxl.d2h_stream((), ipuxl.float32)
        ops.host_store(used_out, ops.host_load(used_in) + 1)
    assert ir.get_all_h2d_streams() == [used_in] and ir.get_all_d2h_streams() == [used_out]
    assert unused_in not in ir.get_all_h2d_streams() and unused_out not in ir.get_all_d2h_streams()


def test_replica_grouping_comes_from_an_ir_and_reprs_its_group_count():
    with pytest.raises(RuntimeError, match="ir.replica_grouping"):
        ipuxl.ReplicaGrouping()
    ir = ipuxl.Ir(replication=8)
    assert repr(ir.replica_grouping(stride=2, group_size=4)) == (
        "ReplicaGrouping(num_replicas=8, stride=2, group_size=4, num_groups=2)")


def test_dtype_tables_and_testing_lists():
    assert _PT_TO_POPXL[torch.float16] is ipuxl.float16 and torch.bfloat16 not in _PT_TO_POPXL
    assert _NP_TO_POPXL[np.dtype("int32")] is ipuxl.int32
    assert testing.get_all_int_dtypes(include_signed=False) == [ipuxl.uint8, ipuxl.uint16, ipuxl.uint32, ipuxl.uint64]
    names = [d.name for d in testing.get_all_dtypes()]
    assert names[:4] == ["int8", "int16", "int32", "int64"] and names[-2:] == ["complex64", "complex128"]
    assert all(hasattr(np, n) for n in names)  # each has a numpy type of the same name, as PopXL's test expects


@pytest.mark.parametrize("value", [0, 100, 2**40 + 7, random_ops.MAX_UINT64])
def test_uint64_seeds_split_into_high_and_low_words(value):
    high, low = random_ops.uint64_to_two_uint32(value)
    assert random_ops.two_uint32_to_uint64(high, low) == value and 0 <= low < 2**32 and high == value >> 32
    for bad in (-1, random_ops.MAX_UINT64 + 1):
        with pytest.raises(ValueError, match="64-bit unsigned"):
            random_ops.uint64_to_two_uint32(bad)


def test_create_seeds_words_are_the_seed_split_high_then_low():
    words = ipuxl.create_seeds(42, replicas=3)
    assert words.shape == (3, 2) and words.dtype == np.uint32
    values = [random_ops.two_uint32_to_uint64(*w) for w in words]
    assert [tuple(random_ops.uint64_to_two_uint32(v)) for v in values] == [tuple(w) for w in words]
