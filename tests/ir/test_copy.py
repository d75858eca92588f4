"""ir.copy: copy_node maps a node's alias records with its arguments; the verifier
refuses records that name another graph's nodes (what a plain fx copy leaves)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import PassError
from ipuxl.ir.copy import NODE_RECORDS, copy_node, node_records, remap_records
from ipuxl.ir.lower import graph_callable
from ipuxl.ir.meta import BY_REF_ARGS, MODIFIES, VIEW_OF, WRITES
from ipuxl.ir.verify import verify_graph, verify_ir

F32 = ipuxl.float32
SPEC = ipuxl.TensorSpec((2, 3), F32)


def _program():
    """A graph whose ops carry every alias record, on inputs and on ops: views
    (``VIEW_OF``), in-place results and a chain of them (``MODIFIES``, ``WRITES``) and
    a call passing an argument by reference (``BY_REF_ARGS``, ``WRITES``)."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        def bump(acc: ipuxl.TensorByRef):
            ops.add_(acc, 1.0)

        inner = ir.create_graph(bump, SPEC)

        def body(w: ipuxl.TensorByRef, g):
            flat = ops.reshape(w, (6,))                        # a view of an input
            updated = ops.scaled_add_(ops.add_(w, g), g, b=0.5)  # in-place results, the second of the first
            ops.call(inner, updated)                           # writes w through the call
            t = g * 3.0
            seen = ops.transpose(t)                            # a view of an op
            ops.add_(t, 1.0)                                   # an in-place write of an op
            return flat + 1.0, updated * 2.0, seen * 1.0, t

        graph = ir.create_graph(body, SPEC, SPEC)
    return ir, graph


def _copy(graph, copier):
    """A new graph of ``graph``'s IR holding a copy of each of its ops (made by ``copier``)."""
    new = graph.ir.create_empty_graph("copied")
    env = {t.node: new.add_input(t.spec, t.name, by_ref=bool(t.node.meta.get("ipuxl_by_ref"))).node
           for t in graph.inputs}
    for node in graph.fx.nodes:
        if node.op == "call_function":
            env[node] = copier(node, new.fx, env)
    new.set_outputs([new.wrap(env[t.node]) for t in graph.outputs])
    return new, env


def _run(graph):
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return graph_callable(graph)(w, torch.full((2, 3), 0.25))


def test_copy_node_remaps_every_alias_record_into_the_new_graph():
    ir, graph = _program()
    new, env = _copy(graph, copy_node)
    named = {key for node in graph.fx.nodes for key, _ in node_records(node)}
    assert named == {"MODIFIES", "VIEW_OF", "WRITES"}  # the program exercises every record
    targets = {target.op for node in graph.fx.nodes for _, target in node_records(node)}
    assert targets == {"placeholder", "call_function"}
    for node in graph.fx.nodes:
        if node.op != "call_function":
            continue
        copied = env[node]
        assert node_records(copied) == [(key, env[target]) for key, target in node_records(node)]
        assert all(target.graph is new.fx for _, target in node_records(copied))
    verify_ir(ir)
    for got, want in zip(_run(new), _run(graph)):
        torch.testing.assert_close(got, want)


def test_copy_node_gives_the_copy_its_own_by_ref_positions():
    ir, graph = _program()
    new, env = _copy(graph, copy_node)
    (call,) = [n for n in graph.fx.nodes if BY_REF_ARGS in n.meta]
    copied = env[call]
    assert copied.meta[BY_REF_ARGS] == {0} and copied.meta[BY_REF_ARGS] is not call.meta[BY_REF_ARGS]
    copied.meta[BY_REF_ARGS].add(1)
    assert call.meta[BY_REF_ARGS] == {0}


def test_copy_node_with_a_function_env_maps_records_through_it():
    ir, graph = _program()
    new = ir.create_empty_graph("lazy")
    made = {}

    def lookup(node):  # inputs made on first use, as the stage splitter makes them
        if node not in made:
            made[node] = new.add_input(graph.wrap(node).spec, node.name).node
        return made[node]

    add_ = next(n for n in graph.fx.nodes if n.meta.get(MODIFIES) is not None)
    copied = copy_node(add_, new.fx, lookup)
    assert copied.meta[MODIFIES] is made[add_.meta[MODIFIES]]
    assert copied.meta[WRITES] == [made[w] for w in add_.meta[WRITES]]
    assert copied.args == tuple(made[a] for a in add_.args)


def test_copy_node_refuses_an_env_without_a_recorded_node():
    ir, graph = _program()
    chained = [n for n in graph.fx.nodes if n.meta.get(MODIFIES) is not None and n.meta[MODIFIES] not in n.args]
    assert chained  # an in-place result of an in-place result: its record is not an argument
    node = chained[0]
    env = {a: a for a in node.all_input_nodes}
    with pytest.raises(KeyError, match=f"^{node.meta[MODIFIES].name}$"):
        copy_node(node, fx.Graph(), env)


def test_remap_records_replaces_only_what_the_function_maps():
    ir, graph = _program()
    node = next(n for n in graph.fx.nodes if n.meta.get(VIEW_OF) is not None)
    source = node.meta[VIEW_OF]
    other = next(n for n in graph.fx.nodes if n.op == "placeholder" and n is not source)
    meta = {VIEW_OF: source, WRITES: [source, other], "val": node.meta["val"]}
    remap_records(meta, lambda n: other if n is source else n)
    assert meta[VIEW_OF] is other and meta[WRITES] == [other, other] and meta["val"] is node.meta["val"]
    assert NODE_RECORDS == (MODIFIES, VIEW_OF, WRITES)


def test_a_plain_fx_copy_leaves_records_naming_the_old_graph_and_the_verifier_says_so():
    ir, graph = _program()
    new, _ = _copy(graph, lambda node, into, env: into.node_copy(node, env.__getitem__))
    with pytest.raises(PassError, match=r"records (MODIFIES|VIEW_OF|WRITES) of '\w+', which is not a node of "
                                        rf"this graph but of graph '{re.escape(graph.name)}'") as err:
        verify_graph(new)
    assert "copy_node" in err.value.fix


def test_the_verifier_names_a_record_of_an_erased_node():
    ir, graph = _program()
    new, env = _copy(graph, copy_node)
    view = next(n for n in new.fx.nodes if n.meta.get(VIEW_OF) is not None)
    view.meta[VIEW_OF] = fx.Graph().placeholder("stray")  # a node of no graph of the IR
    with pytest.raises(PassError, match="records VIEW_OF of 'stray', which is not a node of this graph") as err:
        verify_graph(new)
    assert "but of graph" not in err.value.what
