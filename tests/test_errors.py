"""Every user mistake raises an ``ipuxl.errors`` class with what, where and how to fix it.

Each test checks the exception type, the builtin it also is (so ``except ValueError``
keeps working) and fragments of the message.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import numpy as np
import pytest

import ipuxl
import ipuxl.ops as ops
from ipuxl import errors, transforms
from ipuxl.errors import (
    AutodiffError, OutlineError, CaptureError, DataError, DetachedError, DeviceError, GraphContextError, InvalidArgumentError,
    IpuxlError, NameConflictError, PassError, ShapeMismatchError, StreamInputError, TraceError, BatchSizeError,
    OptionsError, FrozenOptionsError, ReplicaFailureError, ReplicationError, OutOfMemoryError,
)

F32 = ipuxl.float32
THIS_FILE = os.path.basename(__file__)

# What errors.py documents: each class, its ipuxl parent and the builtin(s) it also is.
HIERARCHY = [
    (CaptureError, IpuxlError, ()),
    (GraphContextError, CaptureError, (RuntimeError,)),
    (ShapeMismatchError, CaptureError, (ValueError,)),
    (InvalidArgumentError, CaptureError, (TypeError,)),
    (NameConflictError, CaptureError, (ValueError,)),
    (PassError, IpuxlError, ()),
    (AutodiffError, PassError, (ValueError,)),
    (OutlineError, PassError, (ValueError,)),
    (DeviceError, IpuxlError, (RuntimeError,)),
    (StreamInputError, DeviceError, (ValueError, RuntimeError)),
    (DetachedError, DeviceError, (RuntimeError,)),
    (DataError, IpuxlError, (FileNotFoundError,)),
    (TraceError, CaptureError, (RuntimeError,)),
    (BatchSizeError, StreamInputError, (ValueError, RuntimeError)),
    (OptionsError, IpuxlError, (ValueError,)),
    (FrozenOptionsError, OptionsError, (ValueError, AttributeError)),
    (ReplicaFailureError, DeviceError, (RuntimeError,)),
    (ReplicationError, IpuxlError, (ValueError,)),
    (errors.InplaceOrderError, PassError, (RuntimeError,)),
    (OutOfMemoryError, DeviceError, (RuntimeError, MemoryError)),
    (errors.PatternNotAppliedError, DeviceError, (RuntimeError,)),
    (errors.ApplicationRuntimeError, DeviceError, (RuntimeError,)),  # popart.poplar_application_runtime_error
    (errors.AlreadyWrappedError, IpuxlError, (RuntimeError,)),
    (errors.WrongGraphError, GraphContextError, (ValueError, RuntimeError)),
    (errors.InvalidValueError, CaptureError, (ValueError,)),
    (errors.CallInputError, CaptureError, (ValueError,)),
    (errors.CallIndexError, CaptureError, (IndexError,)),
    (errors.DtypeError, IpuxlError, (ValueError,)),
    (errors.UndefinedValue, IpuxlError, ()),
    (errors.UnsupportedError, IpuxlError, (NotImplementedError, RuntimeError)),
    (errors.CheckpointError, IpuxlError, (ValueError,)),
    (errors.UnknownKeyError, CaptureError, (KeyError,)),
    (errors.PopdistError, IpuxlError, (RuntimeError,)),
    (errors.CompatImportError, IpuxlError, (ModuleNotFoundError, ImportError)),
    (errors.PlacementError, CaptureError, (ValueError,)),
    (errors.DataFileError, IpuxlError, (ValueError,)),
    # PopTorch's error classes (``poptorch.Error`` is ``PoptorchError``)
    (errors.PoptorchError, IpuxlError, ()),
    (errors.RecoverableError, errors.PoptorchError, ()),
    (errors.UnrecoverableError, errors.PoptorchError, ()),
    (errors.ExecutorError, errors.PoptorchError, (RuntimeError,)),
    (errors.AnchorError, errors.ExecutorError, (RuntimeError, AssertionError)),
    (errors.OfflineDeviceError, DetachedError, (RuntimeError, AssertionError)),
    (errors.NoIpuHardwareError, IpuxlError, (AssertionError,)),
    (errors.ConfigFileError, OptionsError, (ValueError, AssertionError)),
    (errors.InferenceOptionsError, OptionsError, (ValueError,)),
    (errors.PopartException, IpuxlError, ()),  # popart.popart_exception
    (errors.OpArgumentError, TraceError, (ValueError, AssertionError, RuntimeError)),
    (errors.OpContextError, TraceError, (RuntimeError,)),
]


@contextlib.contextmanager
def expect(error: type[IpuxlError], builtin: type[Exception], *fragments: str) -> Iterator[pytest.ExceptionInfo]:
    """``pytest.raises(error)``, also checking the builtin base and message fragments."""
    with pytest.raises(error) as info:
        yield info
    assert isinstance(info.value, IpuxlError)
    assert isinstance(info.value, builtin)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def _program():
    """Main graph: x (2,) loaded from stream 'x', stored doubled to stream 'y'."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2,), F32, "x")
        x = ops.host_load(x_stream)
        y_stream = ipuxl.d2h_stream((2,), F32, "y")
        ops.host_store(y_stream, x * 2.0)
        unused = ipuxl.h2d_stream((2,), F32, "never_loaded")
    return ir, x_stream, x, unused


def _subgraph(ir: ipuxl.Ir) -> ipuxl.Graph:
    def double(a):
        return a * 2.0

    return ir.create_graph(double, ipuxl.TensorSpec((2,), F32))


# -- the hierarchy ----------------------------------------------------------------------
@pytest.mark.parametrize("cls, parent, builtins", HIERARCHY, ids=lambda v: getattr(v, "__name__", None))
def test_error_classes_are_ipuxl_errors_and_builtins(cls, parent, builtins):
    assert issubclass(cls, parent) and issubclass(cls, IpuxlError)
    for builtin in builtins:
        assert issubclass(cls, builtin)


def test_every_public_error_class_is_covered():
    exported = (getattr(errors, n) for n in errors.__all__)
    assert {cls for cls, _, _ in HIERARCHY} | {IpuxlError} == {c for c in exported if isinstance(c, type)}


def test_message_has_what_where_and_fix():
    err = InvalidArgumentError("bad thing", where="file.py:3 in f", fix="do it right")
    assert str(err) == "bad thing\n  where: file.py:3 in f\n  fix: do it right"
    assert (err.what, err.where, err.fix) == ("bad thing", "file.py:3 in f", "do it right")


# -- Session.run inputs ---------------------------------------------------------------
def test_run_wrong_stream_shape():
    ir, x_stream, _, _ = _program()
    with ipuxl.Session(ir) as session:
        with expect(StreamInputError, ValueError, "'x'", "expects shape (2,)", "got (3,)"):
            session.run({x_stream: np.zeros(3, np.float32)})


def test_run_wrong_stream_dtype():
    ir, x_stream, _, _ = _program()
    with ipuxl.Session(ir) as session:
        with expect(StreamInputError, ValueError, "'x'", "expects dtype float32", "got int32", "astype"):
            session.run({x_stream: np.zeros(2, np.int32)})


def test_run_missing_stream_input():
    ir, _, _, _ = _program()
    with ipuxl.Session(ir) as session:
        with expect(StreamInputError, ValueError, "no data for input stream 'x'"):
            session.run({})
        with expect(StreamInputError, ValueError, "no data for input stream 'x'"):
            session.run()


def test_run_unknown_stream_input():
    ir, x_stream, _, unused = _program()
    with ipuxl.Session(ir) as session:
        with expect(StreamInputError, ValueError, "does not load", "never_loaded", "fix:", "'x'"):
            session.run({x_stream: np.zeros(2, np.float32), unused: np.zeros(2, np.float32)})


def test_run_while_detached():
    ir, x_stream, _, _ = _program()
    session = ipuxl.Session(ir)
    with expect(DetachedError, RuntimeError, "Session.run", "attached", "with session"):
        session.run({x_stream: np.zeros(2, np.float32)})


def test_session_unknown_device_type():
    ir, _, _, _ = _program()
    with expect(InvalidArgumentError, TypeError, "unknown device type 'tpu'", "ipu_hw"):
        ipuxl.Session(ir, "tpu")


# -- graph context ------------------------------------------------------------------------
def test_tensor_of_another_graph_names_both_graphs():
    ir, _, x, _ = _program()
    graph = _subgraph(ir)
    with graph:
        with expect(GraphContextError, RuntimeError, "op 'add'", f"graph '{graph.name}'",
                    "belongs to graph 'main_graph'", "'x' (2,) float32", "inputs_dict"):
            ops.add(x, x)


def test_tensor_of_another_graph_where_is_users_line():
    ir, _, x, _ = _program()
    with _subgraph(ir):
        with pytest.raises(GraphContextError) as info:
            ops.add(x, x)
    assert THIS_FILE in info.value.where


def test_op_outside_any_graph():
    ir, _, x, _ = _program()
    with expect(GraphContextError, RuntimeError, "no graph is being built", "with ir.main_graph") as info:
        ops.add(x, x)
    assert THIS_FILE in info.value.where
    with expect(GraphContextError, RuntimeError, "no graph is being built"):
        ipuxl.variable(np.zeros(2, np.float32))
    with expect(GraphContextError, RuntimeError, "no graph is being built"):
        ipuxl.h2d_stream((2,), F32)


def test_variable_created_in_subgraph():
    ir = ipuxl.Ir()

    def body(a):
        ipuxl.variable(np.zeros(2, np.float32), name="w")
        return a

    with expect(GraphContextError, RuntimeError, "variable 'w'", "created in subgraph", "body_subgraph(", "main graph",
                "graph_input") as info:
        ir.create_graph(body, ipuxl.TensorSpec((2,), F32))
    assert THIS_FILE in info.value.where


# -- building ops and graphs ------------------------------------------------------------
def test_shape_mismatch_at_build_time_names_op_shapes_and_source_line():
    ir = ipuxl.Ir()
    with ir.main_graph:
        a = ipuxl.constant(np.zeros((2, 3), np.float32), name="a")
        b = ipuxl.constant(np.zeros((4,), np.float32), name="b")
        with expect(ShapeMismatchError, ValueError, "op 'add'", "'a' (2, 3) float32", "'b' (4,) float32") as info:
            ops.add(a, b)
        with expect(ShapeMismatchError, ValueError, "op 'matmul'", "(2, 3)", "(4,)"):
            ops.matmul(a, b)
    assert THIS_FILE in info.value.where
    assert "test_shape_mismatch_at_build_time" in info.value.where


def test_create_graph_passes_a_numpy_argument_through_but_refuses_it_as_an_output():
    """PopXL passes non-tensor arguments to the function unchanged (host data for constants);
    a graph's outputs must still be tensors."""
    ir = ipuxl.Ir()
    with expect(errors.InvalidValueError, ValueError, "Output type: ndarray", "must be None, a Tensor") as info:
        ir.create_graph(lambda a: a, np.zeros(2, np.float32))
    assert THIS_FILE in info.value.where


def test_create_graph_arguments_must_match_signature():
    ir = ipuxl.Ir()
    with expect(errors.InvalidValueError, ValueError, "do not match the signature"):
        ir.create_graph(lambda a: a, ipuxl.TensorSpec((2,), F32), ipuxl.TensorSpec((2,), F32))


def test_autodiff_input_without_differentiable_path():
    ir = ipuxl.Ir()

    def fn(a, unused):
        return a * 2.0

    with ir.main_graph:
        spec = ipuxl.TensorSpec((2,), F32)
        graph = ir.create_graph(fn, spec, spec)
    with expect(AutodiffError, ValueError, "input 'unused'", "no differentiable path", graph.name):
        transforms.autodiff(graph, grads_required=[graph.inputs[1]])


# -- calls ------------------------------------------------------------------------------
def test_call_missing_inputs():
    ir, _, _, _ = _program()
    graph = _subgraph(ir)
    with ir.main_graph:
        with expect(errors.CallInputError, ValueError, f"call of graph '{graph.name}'", "missing inputs ['a']",
                    "inputs_dict") as info:
            ops.call(graph)
    assert THIS_FILE in info.value.where


def test_call_extra_inputs():
    ir, _, x, _ = _program()
    graph = _subgraph(ir)
    with ir.main_graph:
        with expect(errors.CallInputError, ValueError, "2 positional inputs", f"graph '{graph.name}'",
                    "1 inputs", "['a']"):
            ops.call(graph, x, x)


def test_call_input_given_twice():
    ir, _, x, _ = _program()
    graph = _subgraph(ir)
    with ir.main_graph:
        with expect(errors.CallInputError, ValueError, "input 'a'", "given twice"):
            ops.call(graph, x, inputs_dict={graph.inputs[0]: x})


def test_call_inputs_dict_key_not_a_graph_input():
    ir, _, x, _ = _program()
    graph = _subgraph(ir)
    with ir.main_graph:
        with expect(errors.CallInputError, ValueError, "is not an input of the called graph", "['a']"):
            ops.call(graph, inputs_dict={x: x})


@pytest.mark.parametrize("data, got", [(np.zeros(3, np.float32), "(3,) float32"),
                                       (np.zeros(2, np.int32), "(2,) int32")])
def test_call_wrong_input_shape_or_dtype(data, got):
    ir, _, _, _ = _program()
    graph = _subgraph(ir)
    with ir.main_graph:
        wrong = ipuxl.constant(data, name="wrong")
        with expect(ShapeMismatchError, ValueError, f"call of graph '{graph.name}'",
                    "input 'a' expects (2,) float32", f"'wrong' {got}") as info:
            ops.call(graph, wrong)
    assert THIS_FILE in info.value.where


def test_repeat_errors():
    ir, _, x, _ = _program()
    graph = _subgraph(ir)
    mismatched = ir.create_graph(lambda a: ops.reshape(a, (1, 2)), ipuxl.TensorSpec((2,), F32))
    with ir.main_graph:
        with expect(errors.InvalidValueError, ValueError, "repeat count", "-1", graph.name):
            ops.repeat(graph, -1, x)
        with expect(ShapeMismatchError, ValueError, "loop-carried input 0", "(2,)", "(1, 2)"):
            ops.repeat(mismatched, 2, x)


# -- host transfers -------------------------------------------------------------------------
@pytest.mark.parametrize("shape, dtype, carries", [((3,), F32, "(3,) float32"),
                                                   ((2,), ipuxl.int32, "(2,) int32")])
def test_host_store_with_wrong_spec(shape, dtype, carries):
    ir, _, x, _ = _program()
    with ir.main_graph:
        stream = ipuxl.d2h_stream(shape, dtype, "bad")
        with expect(ShapeMismatchError, ValueError, "host_store", "stream 'bad'", f"carries {carries}",
                    "'x' (2,) float32") as info:
            ops.host_store(stream, x)
    assert THIS_FILE in info.value.where


def test_host_store_wrong_arguments_leave_program_unchanged():
    ir, x_stream, x, _ = _program()
    out = ir.get_all_d2h_streams()[0]
    graph = _subgraph(ir)
    with ir.main_graph:
        stream = ipuxl.d2h_stream((2,), F32, "z")
        with expect(InvalidArgumentError, TypeError, "host_store needs a DeviceToHostStream", "'x'"):
            ops.host_store(x, stream)  # arguments swapped
        with expect(InvalidArgumentError, TypeError, "needs a Tensor to store", "3.0"):
            ops.host_store(stream, 3.0)
        with expect(GraphContextError, RuntimeError, "belongs to graph", graph.name):
            ops.host_store(stream, graph.inputs[0])
    with ipuxl.Session(ir) as session:  # no half-built store was left behind
        assert set(session.run({x_stream: np.ones(2, np.float32)})) == {out}


def test_host_transfer_stream_checks():
    ir, _, x, _ = _program()
    other = ipuxl.Ir()
    with other.main_graph:
        foreign = ipuxl.d2h_stream((2,), F32, "foreign")
    with ir.main_graph:
        with expect(InvalidArgumentError, TypeError, "host_load needs a HostToDeviceStream"):
            ops.host_load(ipuxl.d2h_stream((2,), F32, "d2h"))
        with expect(GraphContextError, RuntimeError, "stream 'foreign'", "another Ir"):
            ops.host_store(foreign, x)
    with other.main_graph:
        foreign_in = ipuxl.h2d_stream((2,), F32, "foreign_in")
    with _subgraph(ir):  # host transfers are ops of any graph, of the stream's own Ir
        with expect(GraphContextError, RuntimeError, "stream 'foreign_in'", "another Ir"):
            ops.host_load(foreign_in)


def test_transfers_beyond_num_host_transfers_are_refused_at_run():
    ir = ipuxl.Ir()
    ir.num_host_transfers = 1
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2,), F32, "x")
        ops.host_load(x_stream)
        ops.host_store(ipuxl.d2h_stream((2,), F32, "y"), ops.host_load(x_stream) * 2.0)
    with ipuxl.Session(ir) as session:
        with expect(StreamInputError, ValueError, "stream 'x' is loaded 2 time(s) per run",
                    "ir.num_host_transfers is 1", "set ir.num_host_transfers = 2", "ops.repeat(step_graph, 1)"):
            session.run({x_stream: np.zeros((2,), np.float32)})


# -- variables data ------------------------------------------------------------------
def test_write_variables_data_wrong_shape_or_dtype():
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.zeros((2, 3), np.float32), name="w")
        c = ipuxl.constant(np.zeros(2, np.float32), name="c")
    session = ipuxl.Session(ir)
    with expect(ShapeMismatchError, ValueError, "variable 'w'", "shape (3, 2)", "shape (2, 3)"):
        session.write_variables_data({w: np.zeros((3, 2), np.float32)})
    with expect(InvalidArgumentError, TypeError, "variable 'w'", "dtype int32", "is float32", "astype"):
        session.write_variable_data(w, np.zeros((2, 3), np.int32))
    with expect(InvalidArgumentError, TypeError, "dtype float64"):
        session.write_variable_data(w, np.zeros((2, 3), np.float64))
    with expect(InvalidArgumentError, TypeError, "is not of type Variable"):
        session.write_variable_data(c, np.zeros(2, np.float32))
    with session:  # attached: same checks
        with expect(ShapeMismatchError, ValueError, "variable 'w'", "shape (3,)"):
            session.write_variable_data(w, np.zeros(3, np.float32))
    assert (session.get_tensor_data(w) == 0).all()


def test_tensors_of_another_ir_are_rejected_by_session():
    ir_a, ir_b = ipuxl.Ir(), ipuxl.Ir()
    with ir_a.main_graph:
        w_a = ipuxl.variable(np.zeros(2, np.float32), name="w")
    with ir_b.main_graph:
        ipuxl.variable(np.zeros(2, np.float32), name="w")
    session_b = ipuxl.Session(ir_b)
    with expect(InvalidArgumentError, TypeError, "another Ir", "get_tensors_data"):
        session_b.get_tensor_data(w_a)
    with expect(InvalidArgumentError, TypeError, "another Ir", "write_variables_data"):
        session_b.write_variable_data(w_a, np.zeros(2, np.float32))


# -- run-time failures inside the program -----------------------------------------------
def test_failure_inside_the_program_names_the_step():
    ir = ipuxl.Ir()
    ir.num_host_transfers = 2
    with ir.main_graph:
        index_stream = ipuxl.h2d_stream((3,), ipuxl.int32, "idx")
        rows_stream = ipuxl.d2h_stream((3, 2), F32, "rows")
        table = ipuxl.variable(np.ones((4, 2), np.float32), name="table")
        for _ in range(2):  # two steps, unrolled: each loads its indices
            ops.host_store(rows_stream, ops.gather(table, ops.host_load(index_stream)))
    with ipuxl.Session(ir) as session:
        with expect(DeviceError, RuntimeError, "failed in step 2 of 2", "index out of range", "indices in range"):
            session.run({index_stream: np.array([[0, 1, 2], [0, 1, 9]], np.int32)})
