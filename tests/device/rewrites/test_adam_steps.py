"""``rewrites.adam_steps``: whole Adam/AdamW steps of a graph's weights become one multi-tensor
``fused_adam_steps_`` call per group of shared hyperparameters, where that keeps the results.

Eager PyTorch is the oracle: ``torch.optim.AdamW`` for captured models and popxl.addons'
optimiser; for hand-built lowered graphs, the same graph run before the rewrite. Structural
checks count the fused calls and the unfused ops left in the generated code.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import ipuxl
import ipuxl.ops as ops
from ipuxl.device.rewrites import fuse_adam_steps
from ipuxl.ir.aliases import writes
from ipuxl.ir.meta import MODIFIES, OP, VIEW_OF, WRITES
from ipuxl.kernels import var_updates

TOL = dict(rtol=1e-5, atol=1e-6)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 5)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return out, self.loss(out, y)


def _codes(session: ipuxl.Session) -> list[str]:
    """The generated code of the main program and of every graph compiled on its own."""
    compiled = [session.compiled_graph(g) for g in session.applied_rewrites]
    return [session.code] + [c.module.code for c in compiled if c is not None]


@pytest.mark.parametrize("make_opt", [
    lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
    lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    lambda m: torch.optim.AdamW([dict(params=[m.fc1.weight, m.fc2.weight], weight_decay=0.1),
                                 dict(params=[p for n, p in m.named_parameters() if not n.endswith("weight")
                                              or n.startswith("norm")], lr=0.005)], lr=0.01),
], ids=["adamw", "adam", "adamw-two-groups"])
def test_captured_adam_steps_are_one_fused_call_per_group_and_train_like_eager(make_opt):
    torch.manual_seed(0)
    model = MLP()
    eager = copy.deepcopy(model)
    eager_opt = make_opt(eager)
    opt = make_opt(model)
    ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(3), optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(3 * 4, 12, generator=gen), torch.randint(0, 5, (3 * 4,), generator=gen)
        ipu(x, y)
        for xs, ys in zip(x.chunk(3), y.chunk(3)):
            eager_opt.zero_grad()
            eager(xs, ys)[1].backward()
            eager_opt.step()
    ipu.copyWeightsToHost()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=lambda m, n=name: f"{n}: {m}")
    code = "\n".join(_codes(ipu._require_compiled().session))
    assert "adam_updater" not in code and "moving_average" not in code
    assert code.count("fused_adam_steps_(") == len(opt.param_groups)


# -- hand-built lowered graphs -----------------------------------------------------------------------
def _node(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = torch.empty((), device="meta")
    return node


def _adamw_graph(n: int, reader_after: int | None = None, write_lr_after: int | None = None,
                 ipuxl_write_lr_after: int | None = None, view_read_after: int | None = None,
                 read_weight_inside: int | None = None, shared: str | None = None) -> tuple[fx.Graph, list[str]]:
    """AdamW steps of ``n`` weights as ``optim.rules.adam_`` emits them, in order, with the
    learning rate a 0-dim input. Options: a reader of weight ``reader_after`` (``mul``, its
    result an output) after that weight's update; ``lr.mul_(2)`` after step
    ``write_lr_after``; a reader of weight ``read_weight_inside`` between its decay and its
    update; step 1 using step 0's tensor ``shared`` (``"w"``, ``"m"``) instead of its own;
    ``ipuxl_write_lr_after``: an ipuxl op writing the rate, its alias record naming an IR
    node (as in lowered code); ``view_read_after``: a view of that weight made before
    all steps (its record naming an IR node), read (``mul``, an output) after that step."""
    graph = fx.Graph()
    names = ["lr"] + [f"{k}{i}" for i in range(n) for k in ("w", "g", "m", "v", "s")]
    ph = {}
    for name in names:
        ph[name] = graph.placeholder(name)
        ph[name].meta["val"] = torch.empty(() if name[0] in "ls" else (3, 4), device="meta")
    outputs = []
    lr = ph["lr"]
    ir_node = fx.Graph().placeholder("ir_node")  # what alias records name in lowered code
    if view_read_after is not None:
        view = _node(graph, torch.reshape, ph[f"w{view_read_after}"], (12,))
        view.meta.update({OP: "reshape_", VIEW_OF: ir_node, MODIFIES: ir_node})
    for i in range(n):
        w, g, m, v, s = (ph[f"{k}{0 if (i, k) == (1, shared) else i}"] for k in "wgmvs")
        factor = _node(graph, torch.sub, 1.0, _node(graph, torch.mul, lr, 0.1))
        scaled = _node(graph, var_updates.scale_, w, factor)
        scaled.meta["val"] = w.meta["val"]
        if read_weight_inside == i:
            outputs.append(_node(graph, torch.ops.aten.mul.Tensor, w, 2.0))
        m1 = _node(graph, var_updates.moving_average_, m, g, 0.9)
        v1 = _node(graph, var_updates.moving_average_square_, v, g, 0.999)
        for node, like in ((m1, m), (v1, v)):
            node.meta["val"] = like.meta["val"]
        updater = _node(graph, var_updates.adam_updater, m1, v1, None, s, None, 0.9, 0.999, 1e-8)
        updater.meta["val"] = w.meta["val"]
        _node(graph, torch.Tensor.addcmul_, scaled, updater, _node(graph, torch.neg, lr))
        if reader_after == i:
            outputs.append(_node(graph, torch.ops.aten.mul.Tensor, w, 2.0))
        if write_lr_after == i:
            _node(graph, torch.Tensor.mul_, lr, 2.0)
        if ipuxl_write_lr_after == i:
            _node(graph, var_updates.scale_, lr, 2.0).meta.update({OP: "scale_", WRITES: [ir_node]})
        if view_read_after == i:
            outputs.append(_node(graph, torch.ops.aten.mul.Tensor, view, 2.0))
    graph.output(tuple(outputs))
    return graph, names


def _run(graph: fx.Graph, names: list[str]) -> tuple[list[torch.Tensor], tuple]:
    gen = torch.Generator().manual_seed(0)
    values = {k: (torch.tensor(0.01) if k == "lr" else torch.tensor(2.0) if k[0] == "s"
                  else torch.randn(3, 4, generator=gen).abs() if k[0] == "v" else torch.randn(3, 4, generator=gen))
              for k in names}
    out = fx.GraphModule(torch.nn.Module(), graph)(*values.values())
    return list(values.values()), out


def _fused_calls(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.target is var_updates.fused_adam_steps_]


@pytest.mark.parametrize("case, calls, unfused", [
    (dict(), [3], 0),
    (dict(reader_after=0), [1, 2], 0),  # the reader needs weight 0 updated: the group closes before it
    (dict(write_lr_after=1), [2, 1], 0),  # a written learning rate: the next steps see the new value
    (dict(read_weight_inside=1), [2], 1),  # weight 1 is read between its decay and its update: unfused
    (dict(ipuxl_write_lr_after=1), [2, 1], 0),  # the same, by an ipuxl op (its record names an IR node)
    (dict(view_read_after=0), [1, 2], 0),  # a view of weight 0 made before, read after its step
    (dict(shared="w"), [1], 2),  # two steps of one weight: both unfused
    (dict(shared="m"), [1], 2),  # two steps sharing a moment: both unfused
], ids=["one-group", "reader-between", "rate-written-between", "read-inside-a-step", "rate-written-by-an-op",
        "view-read-between", "shared-weight", "shared-moment"])
def test_groups_close_where_moving_a_step_later_would_change_results(case, calls, unfused):
    graph, names = _adamw_graph(3, **case)
    want_state, want_out = _run(copy.deepcopy(graph), names)
    assert fuse_adam_steps(graph).modified
    graph.lint()
    assert [len(n.args[0]) for n in _fused_calls(graph)] == calls
    assert sum(n.target is var_updates.adam_updater for n in graph.nodes) == unfused
    got_state, got_out = _run(graph, names)
    for name, got, want in zip(names, got_state, want_state):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-7)


def test_float64_steps_keep_the_unfused_formula():
    graph, names = _adamw_graph(2)
    for node in graph.nodes:
        if isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["val"] = node.meta["val"].to(torch.float64)
    assert not fuse_adam_steps(graph).modified


# -- popxl.addons' optimiser: the updater reads the moments, its weight decay term ------------------
def test_addons_adam_optimizer_steps_of_one_graph_fuse_and_match_torch_adamw():
    """One ``AdamOptimizerStep`` graph called for two weights (as the addons' applications
    call a cached optimiser graph): both steps inlined and fused into one call."""
    addons = pytest.importorskip("ipuxl.addons_compat")
    rng = np.random.default_rng(0)
    w0s = [rng.standard_normal((4, 6)).astype(np.float32) for _ in range(2)]
    grads = rng.standard_normal((3, 2, 4, 6)).astype(np.float32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        ws = [ipuxl.variable(w0, name=f"w{i}") for i, w0 in enumerate(w0s)]
        g_stream = ipuxl.h2d_stream((2, 4, 6), ipuxl.float32, name="g")
        args, graph = addons.optimizers.adam.AdamOptimizerStep().create_graph(
            ws[0].spec, ws[0].spec, lr=0.01, weight_decay=0.1, eps=1e-6, first_order_dtype=ipuxl.float32)
        states = [args.init(f"adam{i}") for i in range(2)]
        n = len(states[0].tensors)

        def step(*tensors):
            g = ops.host_load(g_stream)
            for i, state in enumerate(states):
                moments = tensors[2 + i * n:2 + (i + 1) * n]
                graph.bind(addons.NamedTensors.pack(state.named_tensors.keys(), moments)).call(tensors[i], g[i])

        state_tensors = [t for s in states for t in s.tensors]
        body = ir.create_graph(step, *[ipuxl.TensorByRef(t) for t in [*ws, *state_tensors]])
        ops.repeat(body, 3, *ws, *state_tensors)
    ir.num_host_transfers = 3
    with ipuxl.Session(ir, "cpu") as session:
        session.run({g_stream: grads})
        got = [session.get_tensor_data(w) for w in ws]
        code = "\n".join(_codes(session))
        assert session.compiled_graph(graph.graph) is None  # inlined at both call sites
        compiled_body = session.compiled_graph(body)
    assert compiled_body is not None and "adam_updater" not in code
    assert [len(n.args[0]) for n in _fused_calls(compiled_body.module.graph)] == [2]
    fused = _fused_calls(compiled_body.module.graph)[0]
    assert writes(fused)  # it records writes, as the steps did (naming the IR's nodes, as lowered code does)
    params = [torch.nn.Parameter(torch.from_numpy(w0.copy())) for w0 in w0s]
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-6)
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = torch.from_numpy(gi.copy())
        opt.step()
    for value, p in zip(got, params):
        torch.testing.assert_close(torch.from_numpy(np.asarray(value)), p.detach(), **TOL)


def test_graphs_called_from_many_sites_that_are_not_adam_steps_stay_functions():
    """Only Adam steps are copied into every caller: another graph that returns nothing
    and is called twice is compiled once and called."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        ws = [ipuxl.variable(np.ones((2, 2), np.float32) * (i + 1), name=f"w{i}") for i in range(2)]

        def double(t):
            ops.var_updates.accumulate_(t, t)

        double = ir.create_graph(double, ipuxl.TensorByRef(ws[0]))
        assert not double.outputs
        for w in ws:
            ops.call(double, w)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({})
        got = [session.get_tensor_data(w) for w in ws]
        compiled = session.compiled_graph(double)
    assert compiled is not None
    for i, value in enumerate(got):
        torch.testing.assert_close(torch.from_numpy(np.asarray(value)), torch.full((2, 2), 2.0 * (i + 1)))


def test_a_view_made_before_its_weights_step_and_stored_after_it_sees_the_update():
    """``reshape_`` (a view) of a weight, then its Adam step and a store of the view, then
    another weight's step: the fused call must not move the first step past the store."""
    addons = pytest.importorskip("ipuxl.addons_compat")
    rng = np.random.default_rng(0)
    w0s = [rng.standard_normal((4, 6)).astype(np.float32) for _ in range(2)]
    grads = rng.standard_normal((2, 4, 6)).astype(np.float32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        ws = [ipuxl.variable(w0, name=f"w{i}") for i, w0 in enumerate(w0s)]
        g_stream = ipuxl.h2d_stream((2, 4, 6), ipuxl.float32, name="g")
        out = ipuxl.d2h_stream((24,), ipuxl.float32, name="out")
        args, graph = addons.optimizers.adam.AdamOptimizerStep().create_graph(
            ws[0].spec, ws[0].spec, lr=0.01, weight_decay=0.1, eps=1e-6, first_order_dtype=ipuxl.float32)
        states = [args.init(f"adam{i}") for i in range(2)]
        with ipuxl.in_sequence():
            view = ops.reshape_(ws[0], (24,))
            g = ops.host_load(g_stream)
            graph.bind(states[0]).call(ws[0], g[0])
            ops.host_store(out, view)
            graph.bind(states[1]).call(ws[1], g[1])
    with ipuxl.Session(ir, "cpu") as session:
        stored = session.run({g_stream: grads})[out]
        weights = [session.get_tensor_data(w) for w in ws]
    params = [torch.nn.Parameter(torch.from_numpy(w0.copy())) for w0 in w0s]
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-6)
    for p, g in zip(params, grads):
        p.grad = torch.from_numpy(g.copy())
    opt.step()
    torch.testing.assert_close(torch.from_numpy(np.asarray(stored)), params[0].detach().reshape(24), **TOL)
    for value, p in zip(weights, params):
        torch.testing.assert_close(torch.from_numpy(np.asarray(value)), p.detach(), **TOL)
