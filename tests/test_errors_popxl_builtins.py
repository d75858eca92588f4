"""Each documented PopXL error case raises an ``ipuxl.errors`` class that is also the
built-in type PopXL raises (ValueError / TypeError / IndexError / RuntimeError)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import pytest

import ipuxl
import ipuxl.ops as ops
from ipuxl import errors

F32 = ipuxl.float32


def _graph(ir):
    return ir.create_graph(lambda a, b: a * b, ipuxl.TensorSpec((2,), F32), ipuxl.TensorSpec((2,), F32))


@contextlib.contextmanager
def _expect(error: type, builtin: type, *fragments: str) -> Iterator[Any]:
    """``pytest.raises(error)``, also checking the built-in type and message fragments."""
    with pytest.raises(error) as info:
        yield info
    assert isinstance(info.value, errors.IpuxlError) and isinstance(info.value, builtin)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"


def test_call_with_too_many_inputs_is_a_value_error():
    ir = ipuxl.Ir()
    with ir.main_graph:
        g, x = _graph(ir), ipuxl.constant([1.0, 2.0])
        with _expect(errors.CallInputError, ValueError, "3 positional inputs", "which has 2 inputs", "'a', 'b'"):
            ops.call(g, x, x, x)


def test_call_with_a_missing_input_is_a_value_error():
    ir = ipuxl.Ir()
    with ir.main_graph:
        g, x = _graph(ir), ipuxl.constant([1.0, 2.0])
        with _expect(errors.CallInputError, ValueError, "missing inputs ['b']", "inputs_dict"):
            ops.call(g, x)


def test_call_with_an_input_given_twice_is_a_value_error():
    ir = ipuxl.Ir()
    with ir.main_graph:
        g, x = _graph(ir), ipuxl.constant([1.0, 2.0])
        with _expect(errors.CallInputError, ValueError, "input 'a'", "given twice"):
            ops.call(g, x, x, inputs_dict={g.inputs[0]: x})


def test_inputs_dict_key_of_another_graph_is_a_value_error():
    ir = ipuxl.Ir()
    with ir.main_graph:
        g, other, x = _graph(ir), _graph(ir), ipuxl.constant([1.0, 2.0])
        with _expect(errors.CallInputError, ValueError, "is not an input of the called graph"):
            ops.call(g, x, inputs_dict={other.inputs[1]: x})


@pytest.mark.parametrize("value, got", [(np.zeros(3, np.float32), "(3,) float32"),
                                        (np.zeros(2, np.int32), "(2,) int32")])
def test_call_with_a_mismatched_shape_or_dtype_is_a_value_error(value, got):
    ir = ipuxl.Ir()
    with ir.main_graph:
        g, x = _graph(ir), ipuxl.constant([1.0, 2.0])
        with _expect(errors.ShapeMismatchError, ValueError, "input 'b' expects (2,) float32", got):
            ops.call(g, x, ipuxl.constant(value))


def test_call_with_a_tensor_of_another_graph_is_a_value_and_runtime_error():
    ir = ipuxl.Ir()
    with ir.main_graph:
        g = _graph(ir)
        outer = ipuxl.constant([1.0, 2.0])

    def body(a):
        return ops.call(g, a, outer)[0]

    with ir.main_graph:
        with _expect(errors.WrongGraphError, ValueError, "belongs to graph 'main_graph'") as info:
            ir.create_graph(body, ipuxl.TensorSpec((2,), F32))
    assert isinstance(info.value, RuntimeError)


def test_create_graph_with_the_wrong_arity_is_a_value_error():
    ir = ipuxl.Ir()
    with ir.main_graph:  # PopXL raises ValueError, with this sentence
        with _expect(errors.InvalidValueError, ValueError, "do not match the signature", "(a, b)"):
            ir.create_graph(lambda a, b: a + b, ipuxl.TensorSpec((2,), F32))


def test_variable_in_a_subgraph_is_a_value_error():
    ir = ipuxl.Ir()
    with ir.main_graph:
        with _expect(errors.WrongGraphError, ValueError, "variable 'w' created in subgraph", "graph_input"):
            ir.create_graph(lambda a: a + ipuxl.variable([1.0, 2.0], name="w"), ipuxl.TensorSpec((2,), F32))


@pytest.mark.parametrize("count, error, builtin", [(-1, errors.InvalidValueError, ValueError),
                                                   (1.5, errors.InvalidArgumentError, TypeError)])
def test_repeat_count_errors(count, error, builtin):
    ir = ipuxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a: a + 1.0, ipuxl.TensorSpec((2,), F32))
        with _expect(error, builtin, "repeat count"):
            ops.repeat(g, count, ipuxl.constant([1.0, 2.0]))


def test_repeat_of_a_graph_with_more_outputs_than_inputs_is_a_value_error():
    ir = ipuxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a: (a, a + 1.0), ipuxl.TensorSpec((2,), F32))
        with _expect(errors.CallInputError, ValueError, "at least as many inputs as outputs"):
            ops.repeat(g, 2, ipuxl.constant([1.0, 2.0]))


def test_empty_host_operand_is_a_value_error():
    with ipuxl.Ir().main_graph:
        x = ipuxl.constant([1.0, 2.0])
        with _expect(errors.InvalidValueError, ValueError, "has no elements"):
            _ = x @ np.zeros((0,), np.float32)
