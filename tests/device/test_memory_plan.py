"""``ipuxl.device.memory_plan``: large results written into buffers kept between steps.

The plan is checked on hand-built graphs (which results are planned, which share a
buffer, which must not) and on captured programs against eager PyTorch (training with
AdamW over several steps and calls, inference with two replicas taking turns)."""
from __future__ import annotations

import copy
import re

import torch
import torch.fx as fx
import torch.nn as nn

import pytest

import ipuxl
from ipuxl.device import memory_plan
from ipuxl.device.memory_plan import out_overload, plan_memory
from ipuxl.kernels.workspace import Workspace, buffer

aten = torch.ops.aten
CPU = torch.device("cpu")


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    node = graph.call_function(target, args)
    metas = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    with torch.device("meta"):
        node.meta["val"] = target(*metas)
    return node


def _inputs(graph: fx.Graph, *shapes) -> list[fx.Node]:
    nodes = []
    for i, shape in enumerate(shapes):
        node = graph.placeholder(f"x{i}")
        node.meta["val"] = torch.empty(shape, device="meta")
        nodes.append(node)
    return nodes


def _slots(graph: fx.Graph) -> dict[fx.Node, tuple[int, int]]:
    """Each planned result -> its (arena, byte offset)."""
    out = {}
    for node in graph.nodes:
        if node.target is buffer:
            (user,) = node.users
            out[user] = (node.args[1], node.args[2])
    return out


def _run_twice(graph: fx.Graph, root: nn.Module, args) -> list:
    module = fx.GraphModule(root, graph)
    return [module(*args), module(*args)]


def test_results_share_a_buffer_only_when_their_lifetimes_do_not_overlap():
    graph = fx.Graph()
    x, w = _inputs(graph, (6, 6), (6, 6))
    a = _call(graph, aten.mm.default, x, w)
    b = _call(graph, aten.tanh.default, a)  # a is read while b is written: never a's buffer
    c = _call(graph, aten.mm.default, b, w)  # a is dead: c takes a's buffer
    graph.output(_call(graph, aten.sum.default, c))  # returned: not planned
    root, ws = nn.Module(), Workspace()
    assert plan_memory(graph, root, ws, CPU, min_bytes=0) == 3
    slots = _slots(graph)
    assert slots[a] != slots[b] and slots[c] == slots[a], graph
    assert ws.num_arenas == 1 and ws.arena_bytes(0) == 2 * 192  # two 144-byte results, 64-byte aligned
    assert {n.target for n in graph.nodes if n.op == "call_function"} >= {aten.mm.out, aten.tanh.out}
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 6, generator=gen), torch.randn(6, 6, generator=gen)
    for got in _run_twice(graph, root, (x, w)):
        torch.testing.assert_close(got, (torch.tanh(x @ w) @ w).sum())
    assert ws.nbytes() == 2 * 192


def test_results_of_other_shapes_share_bytes_when_never_alive_together():
    graph = fx.Graph()
    x, w, v = _inputs(graph, (6, 6), (6, 6), (6, 12))
    a = _call(graph, aten.mm.default, x, w)  # 6x6, dead once b is made
    b = _call(graph, aten.tanh.default, a)
    c = _call(graph, aten.mm.default, b, v)  # 6x12: twice a's size, alive with b only
    d = _call(graph, aten.tanh.default, c)  # alive with c (and with nothing else)
    graph.output(_call(graph, aten.sum.default, d))
    root, ws = nn.Module(), Workspace()
    assert plan_memory(graph, root, ws, CPU, min_bytes=0) == 4
    slots = _slots(graph)
    # c and d (the largest, 288 bytes: 320 aligned) first, side by side; a takes c's first bytes
    # (a is dead before c is made), b (alive with a and c) d's
    assert slots == {c: (0, 0), d: (0, 320), a: (0, 0), b: (0, 320)}, slots
    assert ws.arena_bytes(0) == 640
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=gen) for s in ((6, 6), (6, 6), (6, 12))]
    for got in _run_twice(graph, root, args):
        torch.testing.assert_close(got, torch.tanh(torch.tanh(args[0] @ args[1]) @ args[2]).sum())


def test_returned_results_and_their_views_keep_their_own_memory():
    graph = fx.Graph()
    x, w = _inputs(graph, (4, 4), (4, 4))
    kept = _call(graph, aten.mm.default, x, w)
    view = _call(graph, aten._unsafe_view.default, kept, [16])  # a view its schema does not declare
    temp = _call(graph, aten.mm.default, x, x)
    graph.output((view, _call(graph, aten.add.Tensor, temp, 1.0)))
    root = nn.Module()
    plan_memory(graph, root, Workspace(), CPU, min_bytes=0)
    assert set(_slots(graph)) == {temp}, graph
    args = (torch.randn(4, 4), torch.randn(4, 4))
    first, second = _run_twice(graph, root, args)
    torch.testing.assert_close(first[0], (args[0] @ args[1]).reshape(16))
    assert first[0].data_ptr() != second[0].data_ptr()  # a new result each run


def test_results_read_by_an_unknown_function_are_not_planned():
    graph = fx.Graph()
    (x,) = _inputs(graph, (4, 4))
    a = _call(graph, aten.mm.default, x, x)
    kept = graph.call_function(lambda t: [t], (a,))  # may keep it: its buffer is not reused
    graph.output(kept)
    plan_memory(graph, nn.Module(), Workspace(), CPU, min_bytes=0)
    assert _slots(graph) == {}


def test_small_results_and_ops_without_an_out_kernel_are_left_alone():
    graph = fx.Graph()
    (x,) = _inputs(graph, (4, 4))
    a = _call(graph, aten.mm.default, x, x)
    b = _call(graph, aten.clone.default, a)  # clone's out= copies after the functional op
    graph.output(_call(graph, aten.sum.default, b))
    assert plan_memory(copy.deepcopy(graph), nn.Module(), Workspace(), CPU) == 0  # under MIN_BYTES
    assert memory_plan.MIN_BYTES == 32 << 20
    plan_memory(graph, nn.Module(), Workspace(), CPU, min_bytes=0)
    assert set(_slots(graph)) == {a}
    assert out_overload(aten.nll_loss_backward.default) is aten.nll_loss_backward.grad_input


def test_cuda_programs_are_not_planned():
    graph = fx.Graph()
    (x,) = _inputs(graph, (4, 4))
    graph.output(_call(graph, aten.mm.default, x, x))
    assert plan_memory(graph, nn.Module(), Workspace(), torch.device("cuda"), min_bytes=0) == 0


@pytest.fixture
def plan_from_1_mib(monkeypatch):
    """Plan results of 1 MiB or more (``MIN_BYTES`` is 32 MiB), so that small models exercise the plan."""
    monkeypatch.setattr(memory_plan, "MIN_BYTES", 1 << 20)


class LM(nn.Module):
    """A language model whose logits, their log-softmax and gradients and the table's
    gradient are above 1 MiB (``plan_from_1_mib``)."""

    def __init__(self, vocab=2100, width=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.body(self.embed(ids))))
        return logits, nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def test_training_with_planned_buffers_matches_eager_over_several_calls(plan_from_1_mib):
    torch.manual_seed(0)
    model = LM()
    eager = copy.deepcopy(model)
    # eps well above float32 noise: a weight whose true gradient is ~0 then follows its
    # gradient, not the rounding of it (Adam divides each gradient by its own size)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, eps=1e-3)
    ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(2),
                              optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids, labels = torch.randint(0, 2100, (4, 64), generator=gen), torch.randint(0, 2100, (4, 64), generator=gen)
        logits, loss = ipu(ids, labels)
        for i, l in zip(ids.chunk(2), labels.chunk(2)):
            opt.zero_grad()
            ref_logits, ref = eager(i, l)
            ref.backward()
            opt.step()
        # the last step's logits (output mode Final) are the host's own copy, not a reused buffer
        torch.testing.assert_close(logits, ref_logits.detach(), rtol=1e-5, atol=1e-5)
    ipu.copyWeightsToHost()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    session = ipu.session
    compiled = [session.compiled_graph(g) for g in session.ir.graphs]
    code = "\n".join([session.code] + [c.module.code for c in compiled if c is not None])
    assert re.search(r"aten\._log_softmax\.out\(", code) and "embedding_grad_into(" in code, code


def test_two_replicas_taking_turns_keep_their_own_buffers(plan_from_1_mib):
    torch.manual_seed(1)
    model = LM().eval()
    ids = torch.randint(0, 2100, (2 * 2 * 4, 64))
    labels = torch.randint(0, 2100, (2 * 2 * 4, 64))
    want_logits, _ = model(ids, labels)
    run = ipuxl.inferenceModel(copy.deepcopy(model), ipuxl.Options().deviceIterations(2).replicationFactor(2)
                               .outputMode(ipuxl.OutputMode.All))
    for _ in range(2):
        logits, _ = run(ids, labels)
        torch.testing.assert_close(logits, want_logits.detach(), rtol=1e-5, atol=1e-5)


def test_detaching_frees_the_buffers_and_the_next_call_makes_them_again(plan_from_1_mib):
    torch.manual_seed(2)
    model = LM().eval()
    ids, labels = torch.randint(0, 2100, (2, 64)), torch.randint(0, 2100, (2, 64))
    want, _ = model(ids, labels)
    run = ipuxl.inferenceModel(copy.deepcopy(model))
    run(ids, labels)
    workspace = run.session._compiler.workspace
    assert workspace.nbytes() >= 2 * 64 * 2100 * 4  # at least the logits' buffer
    run.detachFromDevice()
    assert workspace.nbytes() == 0
    logits, _ = run(ids, labels)
    torch.testing.assert_close(logits, want.detach(), rtol=1e-5, atol=1e-5)
    assert workspace.nbytes() > 0
