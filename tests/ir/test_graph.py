"""Graphs (``ipuxl.ir.graph``): their properties (tensors, variables, constants, inputs, outputs, id)
and op-created hooks; ``Graph.replace_body`` / ``Graph.rebuild``, how passes give a graph a new
body, with handles following."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import PassError
from ipuxl.ir.verify import verify_ir

F32 = ipuxl.float32


def _exp_times_two():
    """A subgraph y = exp(x) * 2 called from the main graph; returns (ir, graph, x stream, y stream)."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        xs = ipuxl.h2d_stream((3,), F32, "x")
        x = ops.host_load(xs)
        graph = ir.create_graph(lambda t: ops.exp(t) * 2.0, x)
        (y,) = ops.call(graph, x)
        ys = ipuxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(ys, y)
    return ir, graph, xs, ys


def _run(ir, xs, ys):
    with ipuxl.Session(ir, "cpu") as session:
        return session.run({xs: np.arange(3, dtype=np.float32)})[ys]


def test_replace_body_keeps_the_handles_of_inputs_and_outputs():
    ir, graph, xs, ys = _exp_times_two()
    x, y = graph.inputs[0], graph.outputs[0]
    exp = next(n for n in graph.fx.nodes if n.op == "call_function")
    new = torch.fx.Graph()
    new_x = new.placeholder(x.node.target)
    new_x.meta.update(x.node.meta)
    new_exp = new.node_copy(exp, lambda n: new_x)
    graph.replace_body(new, {x.node: new_x, y.node: new_exp})  # y = exp(x) now
    assert graph.fx is new and graph.inputs == (x,) and graph.outputs == (y,)
    assert x.node is new_x and y.node is new_exp and graph.wrap(new_exp) is y
    verify_ir(ir)
    np.testing.assert_allclose(_run(ir, xs, ys), np.exp(np.arange(3, dtype=np.float32)))


def test_two_old_nodes_mapped_to_one_new_node_share_the_first_handle():
    ir = ipuxl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(lambda t: (ops.exp(t), ops.exp(t)), ipuxl.TensorSpec((2,), F32))
    first, second = graph.outputs
    x = graph.inputs[0]
    new = torch.fx.Graph()
    fresh = new.placeholder(x.node.target)
    fresh.meta.update(x.node.meta)
    exp = new.node_copy(first.node, lambda n: fresh)
    graph.replace_body(new, {x.node: fresh, first.node: exp, second.node: exp})
    assert graph.outputs == (first, first)
    verify_ir(ir)


def test_an_output_left_unmapped_is_refused():
    ir, graph, _, _ = _exp_times_two()
    x = graph.inputs[0]
    new = torch.fx.Graph()
    fresh = new.placeholder(x.node.target)
    fresh.meta.update(x.node.meta)
    with pytest.raises(PassError, match=r"without the node of output\(s\) \['.*'\]"):
        graph.replace_body(new, {x.node: fresh})


def test_rebuild_builds_the_new_body_with_ops():
    ir, graph, xs, ys = _exp_times_two()
    x, y = graph.inputs[0], graph.outputs[0]
    new = torch.fx.Graph()
    new_x = new.placeholder(x.node.target)
    new_x.meta.update(x.node.meta)
    node_map = {x.node: new_x}
    old_y = y.node
    with graph.rebuild(new, node_map), graph:
        assert x.node is new_x  # the inputs follow at once: ops can read them
        node_map[old_y] = ops.log(x + 1.0).node
    assert graph.outputs == (y,) and y.node.graph is new
    verify_ir(ir)
    np.testing.assert_allclose(_run(ir, xs, ys), np.log(np.arange(3, dtype=np.float32) + 1.0), rtol=1e-6)


def test_replace_body_with_the_same_fx_graph_moves_handles_of_replaced_nodes():
    ir, graph, xs, ys = _exp_times_two()
    y = graph.outputs[0]
    old = y.node
    with graph.fx.inserting_after(old):
        doubled = graph.fx.call_function(torch.mul, (old, 2.0))
    doubled.meta["val"] = old.meta["val"]
    graph.replace_body(graph.fx, {old: doubled})  # y = exp(x) * 2 * 2
    assert graph.outputs == (y,) and y.node is doubled and graph.handle(old) is None
    verify_ir(ir)
    np.testing.assert_allclose(_run(ir, xs, ys), 4 * np.exp(np.arange(3, dtype=np.float32)), rtol=1e-6)


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
