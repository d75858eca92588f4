"""passes.inplace_order: side-effect constraints and the ambiguous-read verifier.

The verifier flags a read and an in-place write of one storage that no data path
orders (ipuxl runs program order; PopXL's scheduler may not), unless both are
``in_sequence`` ops. It accepts the normal patterns: updates whose value depends on
what they overwrite, reads of the tensor an in-place op returns, ``in_sequence``
blocks, and the example programs.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from tests.conftest import load_example
from ipuxl.errors import InplaceOrderError, PassError
from ipuxl.passes.inplace_order import ambiguous_pairs, side_effect_constraints, verify_inplace_order

F32 = ipuxl.float32
THIS_FILE = os.path.basename(__file__)


def _all_graphs_clean(ir: ipuxl.Ir) -> list:
    return [(g.name, r.name, w.name) for g in ir.graphs for r, w, _ in ambiguous_pairs(g)]


# -- the verifier catches ambiguous reads --------------------------------------------------
def _read_then_update(sequence: bool = False, returned: bool = False):
    """y = w * 2 and accumulate_(w, x): no data path between them (unless ``returned``)."""
    ir = ipuxl.Ir()
    with ir.main_graph, ipuxl.in_sequence(sequence):
        w = ipuxl.variable(np.ones(3, np.float32), name="w")
        x = ipuxl.variable(np.full(3, 2.0, np.float32), name="x")
        w_new = ops.var_updates.accumulate_(w, x)
        y = (w_new if returned else w) * 2.0
        y_stream = ipuxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(y_stream, y)
    return ir, y_stream


def test_read_after_update_without_data_path_is_ambiguous():
    ir, _ = _read_then_update()
    with pytest.raises(InplaceOrderError) as info:
        verify_inplace_order(ir.main_graph)
    message = str(info.value)
    for fragment in ("ambiguous read of 'w'", "op 'mul'", "node 'mul'", "op 'accumulate_'", "node 'accumulate__w'",
                     "in_sequence", "tensor returned by the in-place op", "the write first"):
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert message.count(THIS_FILE) >= 2  # both ops' source lines (and the where: line)
    assert isinstance(info.value, PassError) and isinstance(info.value, RuntimeError)
    with pytest.raises(InplaceOrderError):
        verify_inplace_order(ir)  # an Ir: every graph


def test_read_before_update_without_data_path_is_ambiguous():
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.ones(3, np.float32), name="w")
        x = ipuxl.variable(np.full(3, 2.0, np.float32), name="x")
        y = w * 2.0
        ops.scaled_add_(w, x, b=-0.5)
        ops.host_store(ipuxl.d2h_stream(y.shape, y.dtype, "y"), y)
    with pytest.raises(InplaceOrderError) as info:
        verify_inplace_order(ir.main_graph)
    message = str(info.value)
    for fragment in ("op 'mul'", "op 'scaled_add_'", "'w'", "the read first", "ipuxl.in_sequence()"):
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert THIS_FILE in info.value.where


def test_by_reference_call_writing_a_read_tensor_is_ambiguous():
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.ones(3, np.float32), name="w")
        x = ipuxl.variable(np.full(3, 2.0, np.float32), name="x")

        def update(t, d):
            ops.var_updates.accumulate_(t, d)

        graph = ir.create_graph(update, ipuxl.TensorByRef(w), x)
        y = w * 2.0
        ops.call(graph, w, x)
        ops.host_store(ipuxl.d2h_stream(y.shape, y.dtype, "y"), y)
    verify_inplace_order(graph)  # the subgraph itself is fine
    with pytest.raises(InplaceOrderError) as info:
        verify_inplace_order(ir)
    message = str(info.value)
    call_node = next(n for n in ir.main_graph.fx.nodes if n.meta.get("ipuxl_called_graph") is graph)
    for fragment in ("op 'mul'", "op 'call'", f"node '{call_node.name}'", "'w'", "in_sequence"):
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_by_value_call_modifying_its_copy_is_not_a_write():
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.ones(3, np.float32), name="w")
        x = ipuxl.variable(np.full(3, 2.0, np.float32), name="x")

        def update(t, d):
            return ops.var_updates.accumulate_(t, d)

        graph = ir.create_graph(update, w, x)
        y = w * 2.0
        ops.call(graph, w, x)
    assert graph.is_input_modified(graph.inputs[0])
    verify_inplace_order(ir)
    assert not any(side_effect_constraints(ir.main_graph).values())
    del y


def test_two_unordered_writes_are_ambiguous():
    ir = ipuxl.Ir()
    with ir.main_graph:
        acc = ipuxl.variable(np.zeros(3, np.float32), name="acc")
        a = ipuxl.variable(np.ones(3, np.float32), name="a")
        ops.var_updates.accumulate_(acc, a)
        ops.var_updates.accumulator_scale_(acc, 0.5)
    pairs = ambiguous_pairs(ir.main_graph)
    assert [(r.meta["ipuxl_op"], w.meta["ipuxl_op"]) for r, w, _ in pairs] == [("accumulate_", "accumulator_scale_")]


def test_read_through_a_view_counts():
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.ones((2, 3), np.float32), name="w")
        x = ipuxl.variable(np.ones((2, 3), np.float32), name="x")
        flat = w.reshape((6,))
        ops.scaled_add_(w, x)
        y = flat * 2.0
    assert {r.name for r, _, _ in ambiguous_pairs(ir.main_graph)} == {flat.node.name, y.node.name}


# -- the verifier accepts the normal patterns -----------------------------------------------
def test_same_program_in_sequence_is_accepted():
    ir, _ = _read_then_update(sequence=True)
    verify_inplace_order(ir)


def test_reading_the_returned_tensor_is_accepted():
    ir, y_stream = _read_then_update(returned=True)
    verify_inplace_order(ir)
    with ipuxl.Session(ir) as session:
        np.testing.assert_array_equal(session.run()[y_stream], np.full(3, 6.0, np.float32))


def test_update_whose_gradient_depends_on_the_weight_is_accepted():
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.ones(3, np.float32), name="w")
        x = ipuxl.variable(np.full(3, 2.0, np.float32), name="x")
        y = w * x  # forward: reads w
        g = y * x  # "gradient": depends on the read
        ops.scaled_add_(w, g, b=-0.1)
        loss = ops.sum(y)
        ops.host_store(ipuxl.d2h_stream(loss.shape, loss.dtype, "loss"), loss)
    verify_inplace_order(ir)


def test_optimiser_modules_and_rules_in_sequence_are_accepted():
    from ipuxl.addons_compat.optimizers import AdamWUpdate, SGDUpdate

    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.ones((2, 2), np.float32), name="w")
        v = ipuxl.variable(np.ones((2, 2), np.float32), name="v")
        g = ops.matmul(w, w)
        for module, weight, kw in ((SGDUpdate(), w, dict(lr=0.1, momentum=0.9, dampening=0.1)),
                                   (AdamWUpdate(), v, dict(lr=1e-3, weight_decay=0.1))):
            facts, graph = module.create_graph(weight, g.spec, **kw)
            graph.bind(facts.init()).call(weight, g * 1.0)
    assert _all_graphs_clean(ir) == []


def test_example_and_seed_programs_are_accepted():
    """Every graph of the seed-001/002/004-style examples (training and test programs)."""
    popxl_mnist = load_example("popxl_mnist")
    addons_mnist = load_example("addons_mnist")
    custom = load_example("custom_optimiser_mnist")
    irs = [popxl_mnist.build_train_ir(8, 0.1)[0], popxl_mnist.build_test_ir(8)[0]]
    for net in (addons_mnist.Net, addons_mnist.NetOutlined):
        irs.append(addons_mnist.train_program(8, "cpu", 0.1, net=net)[0].ir)
        irs.append(addons_mnist.test_program(8, "cpu", net=net)[0].ir)
    irs.append(addons_mnist.train_program(8, "cpu", 1e-3, optimiser=custom.adam_step)[0].ir)
    for ir in irs:
        assert _all_graphs_clean(ir) == []
        verify_inplace_order(ir)


def test_data_parallel_example_has_no_ambiguous_read():
    """The example updates each weight with the tensor ``replicated_all_reduce_`` returns,
    so the data path orders every update after its all-reduce."""
    data_parallel = load_example("data_parallel_mnist")
    session = data_parallel.train_program(8, 2, "cpu", 0.1, 1)[0]
    for graph in session.ir.graphs:
        assert ambiguous_pairs(graph) == []
        verify_inplace_order(graph)


# -- side_effect_constraints -------------------------------------------------------------------
def test_constraints_keep_reads_and_writes_of_a_storage_in_program_order():
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.ones(3, np.float32), name="w")
        x = ipuxl.variable(np.ones(3, np.float32), name="x")
        r1 = w * 2.0
        r2 = w + 1.0
        m1 = ops.var_updates.accumulate_(w, x)
        r3 = w * 3.0
        m2 = ops.var_updates.accumulator_scale_(w, 0.5)
        free = x * 4.0
    before = side_effect_constraints(ir.main_graph)
    assert before[m1.node] == {r1.node, r2.node}  # read-before-write
    assert before[r3.node] == {m1.node}  # write-before-read
    assert before[m2.node] == {m1.node, r3.node}  # writes keep their order
    assert before[free.node] == set() and before[r1.node] == set()


def test_constraints_chain_in_sequence_ops_host_stores_and_collectives():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        x = ipuxl.variable(np.ones(3, np.float32), name="x")
        s1, s2 = (ipuxl.d2h_stream((3,), F32, n) for n in ("s1", "s2"))
        a = ops.collectives.replicated_all_reduce(x * 1.0)
        b = ops.collectives.replicated_all_reduce(x * 2.0)
        ops.host_store(s1, x * 3.0)
        ops.host_store(s2, x * 4.0)
        with ipuxl.in_sequence():
            p = x + 1.0
            q = x + 2.0
    before = side_effect_constraints(ir.main_graph)
    stores = [n for n in ir.main_graph.fx.nodes if n.meta.get("ipuxl_op") == "host_store"]
    assert a.node in before[b.node]
    assert stores[0] in before[stores[1]]
    assert p.node in before[q.node]


def test_call_of_a_graph_with_a_collective_keeps_its_place_among_collectives():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        x = ipuxl.variable(np.ones(3, np.float32), name="x")
        graph = ir.create_graph(lambda t: ops.collectives.replicated_all_reduce(t), x.spec)
        (c,) = ops.call(graph, x)
        d = ops.collectives.replicated_all_reduce(x * 2.0)
    assert c.node.args[0] in side_effect_constraints(ir.main_graph)[d.node]


def test_program_order_still_decides_results():
    """The verifier is a check users call; Session keeps program order (write first here)."""
    ir, y_stream = _read_then_update()
    with ipuxl.Session(ir) as session:
        np.testing.assert_array_equal(session.run()[y_stream], torch.full((3,), 6.0).numpy())


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adamw"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_poptorch_training_programs_have_no_ambiguous_read(optimizer, accumulation):
    """A trainingModel's step (dropout seed update, BatchNorm buffer updates per
    micro-batch, decoupled weight decay) is built in sequence: every in-place update of a
    weight, buffer or the seed is ordered after the reads of it."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn, self.head = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

        def forward(self, x, y):
            out = self.head(F.dropout(self.bn(self.fc(x)), 0.2, self.training))
            return out, F.cross_entropy(out, y)

    net = Net()
    make = {"sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1)}[optimizer]
    opts = ipuxl.Options()
    opts.Training.gradientAccumulation(accumulation)
    model = ipuxl.trainingModel(net, opts, optimizer=make(net.parameters()))
    model(torch.randn(4 * accumulation, 8), torch.randint(0, 3, (4 * accumulation,)))
    for graph in model._session.ir.graphs:
        assert ambiguous_pairs(graph) == [], graph.name
    verify_inplace_order(model._session.ir)
