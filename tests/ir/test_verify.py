"""ir.verify: a well-formed IR passes; each broken invariant is named, with the graph and node."""
from __future__ import annotations

import operator

import numpy as np
import pytest

import ipuxl
import ipuxl.ops as ops
from ipuxl import transforms
from ipuxl.errors import PassError
from ipuxl.ir.calls import call_nodes
from ipuxl.ir.meta import ROLE, VIEW_OF, Role
from ipuxl.ir.verify import verify_graph, verify_ir

F32 = ipuxl.float32


def _program():
    """Main graph calling a two-op subgraph; returns (ir, subgraph, call node)."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.ones((2, 3), np.float32), F32, name="x")
        w = ipuxl.variable(np.ones((3, 3), np.float32), F32, name="w")
        sub = ir.create_graph(lambda a, b: ops.tanh(a @ b), x, w)
        (y,) = ops.call(sub, x, w)
        ops.host_store(ipuxl.d2h_stream(y.shape, y.dtype, "y"), y)
    (call,) = call_nodes(ir.main_graph)
    return ir, sub, call


def _ops(graph):
    return [n for n in graph.fx.nodes if n.op == "call_function"]


def test_a_built_and_differentiated_ir_passes():
    ir, sub, _ = _program()
    with ir.main_graph:
        transforms.autodiff(sub)
    verify_ir(ir)


def test_a_node_used_before_it_is_defined_fails_fx_lint():
    ir, sub, _ = _program()
    matmul, tanh = _ops(sub)
    matmul.prepend(tanh)  # tanh now reads matmul before it exists
    with pytest.raises(PassError, match=r"graph '.*subgraph.*': the fx graph is malformed"):
        verify_graph(sub)


def test_a_placeholder_after_an_op_is_refused():
    ir, sub, _ = _program()
    unused = sub.add_input(ipuxl.TensorSpec((1,), F32), "c")
    _ops(sub)[-1].append(unused.node)  # an input nothing reads, moved after the ops
    with pytest.raises(PassError, match="placeholder 'c' comes after op 'matmul'"):
        verify_graph(sub)


def test_an_input_without_the_input_role_is_refused():
    ir, sub, _ = _program()
    sub.inputs[1].node.meta[ROLE] = Role.H2D
    with pytest.raises(PassError, match="input 'b' is a placeholder with role 'h2d'"):
        verify_graph(sub)


def test_an_output_whose_node_was_erased_is_refused():
    ir, sub, _ = _program()
    sub.fx.erase_node(sub.outputs[0].node)  # by hand, behind the graph's back
    with pytest.raises(PassError, match=r"output 0 \('tanh'\) stands for node 'tanh', which is not in the graph"):
        verify_graph(sub)


def test_a_node_without_its_spec_is_refused():
    ir, sub, _ = _program()
    del _ops(sub)[0].meta["val"]
    with pytest.raises(PassError, match="node 'matmul' has no meta\\['val'\\]") as err:
        verify_graph(sub)
    assert "node 'matmul'" in err.value.where


def test_an_alias_record_naming_another_graphs_node_is_refused():
    ir, sub, call = _program()
    _ops(sub)[1].meta[VIEW_OF] = call  # a node of the main graph
    with pytest.raises(PassError, match="records VIEW_OF of 'call_.*', which is not a node of this graph"):
        verify_graph(sub)


def test_a_call_with_the_wrong_number_of_arguments_is_refused():
    ir, sub, call = _program()
    call.args = call.args[:1]
    with pytest.raises(PassError, match="passes 1 arguments to graph '.*', which has 2 inputs"):
        verify_graph(ir.main_graph)


def test_a_call_of_a_graph_outside_the_ir_is_refused():
    ir, sub, call = _program()
    ir.graphs.remove(sub)
    with pytest.raises(PassError, match="calls graph '.*', which is not in this IR"):
        verify_ir(ir)


def test_a_getitem_past_the_callees_outputs_is_refused():
    ir, sub, call = _program()
    (item,) = [u for u in call.users if u.target is operator.getitem]
    item.args = (call, 3)
    with pytest.raises(PassError, match="reads result 3 of 'call_.*', which has 1"):
        verify_graph(ir.main_graph)


def test_grad_info_of_another_graph_is_refused():
    ir, sub, _ = _program()
    with ir.main_graph:
        info = transforms.autodiff(sub)
    info.graph.grad_info = info
    with pytest.raises(PassError, match="its grad_info differentiates graph"):
        verify_ir(ir)
