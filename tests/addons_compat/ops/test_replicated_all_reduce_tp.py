"""Tensor parallelism as popxl.addons does it: TP all-reduces, sharded layers, TP x DP groupings.

Eager torch is the oracle: a TP program over ``tp`` replicas (weights sharded per replica
group) gives, on every replica, the values and gradients of the unsharded model; with
``dp`` data-parallel groups besides, each group computes its own batch.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.addons_compat.layers import Embedding, LayerNormDistributed, Linear, LinearGQ
from ipuxl.addons_compat.ops.cross_entropy_sharded_loss import cross_entropy_sharded_loss
from ipuxl.addons_compat.ops.grad_reduce_square_add import grad_reduce_square_add
from ipuxl.addons_compat.ops.group_quantize_decompress import (
    group_quantize_compress_numpy, group_quantize_decompress_numpy,
)
from ipuxl.addons_compat.ops.replicated_all_reduce_TP import (
    replicated_all_reduce, replicated_all_reduce_identical_grad_inputs, replicated_all_reduce_identical_inputs,
)
from ipuxl.addons_compat.ops.rotary_pos_embed import rotary_pos_embed, trig_table_constants, trig_tables
from ipuxl.addons_compat.patterns import apply_pre_alias_patterns
from ipuxl.errors import (
    DeviceError, InvalidValueError, PopartException, ReplicationError, ShapeMismatchError, UnknownKeyError,
    UnsupportedError,
)

F32 = ipuxl.float32
rng = np.random.default_rng(0)


def _run(ir: ipuxl.Ir, outputs: dict[str, ipuxl.Tensor], patterns: str | None = "default") -> dict[str, np.ndarray]:
    """Store ``outputs`` (per replica), apply the patterns, run once: ``{name: (replicas, *shape)}``."""
    with ir.main_graph:
        streams = {}
        for name, t in outputs.items():
            streams[name] = ipuxl.d2h_stream(t.shape, t.dtype, name)
            ops.host_store(streams[name], t)
    if patterns is not None:
        apply_pre_alias_patterns(ir, level=patterns)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run()
    return {name: got[s].reshape(ir.replication_factor, *outputs[name].shape) for name, s in streams.items()}


def _shards(w: np.ndarray, n: int, axis: int) -> np.ndarray:
    return np.stack(np.split(w, n, axis=axis))


# -- the TP feed-forward: column-sharded, GELU, row-sharded, all-reduced --------------------------
def _ff(x, w1, w2, group):
    z = replicated_all_reduce_identical_inputs(x, group=group)
    y = ops.gelu(z @ w1) @ w2
    return replicated_all_reduce_identical_grad_inputs(y, group=group)


def _eager_ff(x, w1, w2, dy):
    x, w1, w2 = (torch.tensor(a, requires_grad=True) for a in (x, w1, w2))
    y = F.gelu(x @ w1, approximate="tanh") @ w2  # PopXL's gelu is the tanh form (geluerf the exact one)
    y.backward(torch.tensor(dy))
    return y.detach(), x.grad, w1.grad, w2.grad


@pytest.mark.parametrize("tp, dp", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_tp_feed_forward_gives_the_unsharded_values_and_gradients(tp, dp):
    """TP=1 is the reference program; TP=2/4 (and 2 x DP 2) give its values and gradients:
    the entry all-reduce's gradient sums the shards' partial input gradients, the exit
    all-reduce sums their partial outputs and passes the output gradient through."""
    d, h = 8, 16
    xs = rng.standard_normal((dp, 4, d)).astype(np.float32)
    dys = rng.standard_normal((dp, 4, d)).astype(np.float32)
    w1 = rng.standard_normal((d, h)).astype(np.float32) / 3
    w2 = rng.standard_normal((h, d)).astype(np.float32) / 3
    ir = ipuxl.Ir(replication=tp * dp)
    with ir.main_graph:
        tp_rg = ir.replica_grouping(stride=tp, group_size=dp)  # one weight shard per TP position
        dp_rg = ir.replica_grouping(stride=1, group_size=tp)  # one batch per DP group
        x = ipuxl.variable(xs if dp > 1 else xs[0], F32, "x", replica_grouping=dp_rg)
        dy = ipuxl.variable(dys if dp > 1 else dys[0], F32, "dy", replica_grouping=dp_rg)
        v1 = ipuxl.variable(_shards(w1, tp, 1) if tp > 1 else w1, F32, "w1", replica_grouping=tp_rg)
        v2 = ipuxl.variable(_shards(w2, tp, 0) if tp > 1 else w2, F32, "w2", replica_grouping=tp_rg)
        graph = ir.create_graph(_ff, x, v1, v2, tp_rg.transpose())
        fwd = ops.call_with_info(graph, x, v1, v2)
        grad = addons.autodiff(addons.GraphWithNamedArgs(graph))
        dx, dw1, dw2 = grad.call(dy, args=grad.grad_graph_info.inputs_dict(fwd))
    got = _run(ir, {"y": fwd.outputs[0], "dx": dx, "dw1": dw1, "dw2": dw2})
    for r in range(tp * dp):
        b, shard = r // tp, r % tp
        y, gx, gw1, gw2 = _eager_ff(xs[b], w1, w2, dys[b])
        assert_close(torch.tensor(got["y"][r]), y, rtol=1e-5, atol=1e-5)
        assert_close(torch.tensor(got["dx"][r]), gx, rtol=1e-5, atol=1e-5)
        assert_close(torch.tensor(got["dw1"][r]), gw1.chunk(tp, 1)[shard], rtol=1e-5, atol=1e-5)
        assert_close(torch.tensor(got["dw2"][r]), gw2.chunk(tp, 0)[shard], rtol=1e-5, atol=1e-5)


def test_the_gradient_rules_of_the_three_forms():
    """Each form's forward and gradient, on 2 replicas whose inputs differ: identical_inputs
    is an identity with a summed gradient, identical_grad_inputs a sum with an identity
    gradient, the plain form sums both ways."""
    data = np.stack([np.full(3, 1.0), np.full(3, 10.0)]).astype(np.float32)
    grads = np.stack([np.full(3, 2.0), np.full(3, 5.0)]).astype(np.float32)
    expected = {  # form: (forward of replica r, gradient of replica r)
        replicated_all_reduce_identical_inputs: (data, grads.sum(0, keepdims=True).repeat(2, 0)),
        replicated_all_reduce_identical_grad_inputs: (data.sum(0, keepdims=True).repeat(2, 0), grads),
        replicated_all_reduce: (data.sum(0, keepdims=True).repeat(2, 0), grads.sum(0, keepdims=True).repeat(2, 0)),
    }
    for form, (want_y, want_dx) in expected.items():
        ir = ipuxl.Ir(replication=2)
        with ir.main_graph:
            rg = ir.replica_grouping(group_size=1)
            x = ipuxl.variable(data, F32, "x", replica_grouping=rg)
            dy = ipuxl.variable(grads, F32, "dy", replica_grouping=rg)
            graph = ir.create_graph(lambda t: form(t) * 1.0, x)
            fwd = ops.call_with_info(graph, x)
            info = ipuxl.transforms.autodiff(graph)
            (dx,) = ops.call(info.graph, dy, inputs_dict=info.inputs_dict(fwd))
        got = _run(ir, {"y": fwd.outputs[0], "dx": dx})
        assert_close(got["y"], want_y, msg=form.__name__)
        assert_close(got["dx"], want_dx, msg=form.__name__)


# -- the patterns --------------------------------------------------------------------------------
def _identity_program() -> tuple[ipuxl.Ir, ipuxl.Tensor]:
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        y = replicated_all_reduce_identical_inputs(ipuxl.variable(np.ones(2, np.float32), name="x")) + 1.0
    return ir, y


def test_identical_inputs_ops_run_only_after_the_identity_pattern():
    ir, y = _identity_program()
    with pytest.raises(DeviceError, match="You need to run the `OpToIdentityPattern` pattern") as info:
        _run(ir, {"y": y}, patterns=None)
    assert isinstance(info.value, RuntimeError) and "apply_pre_alias_patterns" in info.value.fix
    assert isinstance(info.value, PopartException)  # popart.popart_exception, as PopART raises
    ir, y = _identity_program()
    with pytest.raises(DeviceError, match="OpToIdentityPattern"):
        _run(ir, {"y": y}, patterns="minimal")  # mandatory patterns only: OpToIdentity is not one
    for level in ("default", "all"):
        ir, y = _identity_program()
        assert_close(_run(ir, {"y": y}, patterns=level)["y"], np.full((2, 2), 2.0, np.float32))


def test_an_unknown_patterns_level_is_a_key_error():
    ir, _ = _identity_program()
    with pytest.raises(UnknownKeyError, match="unknown patterns level 'fast'") as info:
        apply_pre_alias_patterns(ir, level="fast")  # type: ignore[arg-type]
    assert isinstance(info.value, KeyError) and "'default'" in info.value.fix


def test_only_add_is_implemented():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph, pytest.raises(UnsupportedError, match="op 'mean' is not implemented") as info:
        replicated_all_reduce(ipuxl.variable(np.ones(2, np.float32)), op="mean")
    assert isinstance(info.value, NotImplementedError)


# -- sharded layers --------------------------------------------------------------------------------
def test_sharded_linear_layers_match_torch_with_tp_2():
    """Linear(replica_grouping=...) holds one shard per group; column then row sharding joined
    by the TP all-reduces is torch's two linear layers."""
    d, h, tp = 6, 8, 2
    x_np = rng.standard_normal((5, d)).astype(np.float32)
    fc1, fc2 = torch.nn.Linear(d, h), torch.nn.Linear(h, d, bias=False)

    class FF(addons.Module):
        def build(self, x):
            rg = ipuxl.gcg().ir.replica_grouping(stride=tp, group_size=1)
            self.fc1, self.fc2 = Linear(h // tp, replica_grouping=rg), Linear(d, bias=False, replica_grouping=rg)
            z = replicated_all_reduce_identical_inputs(x, group=rg.transpose())
            return replicated_all_reduce_identical_grad_inputs(self.fc2(ops.relu(self.fc1(z))), group=rg.transpose())

    ir = ipuxl.Ir(replication=tp)
    with ir.main_graph:
        x = ipuxl.variable(x_np, name="x")
        facts, graph = FF().create_graph(x)
        variables = facts.init()
        (y,) = graph.bind(variables).call(x)
    assert variables.fc1.weight.shape == (d, h // tp) and variables.fc1.weight.shape_on_host == (tp, d, h // tp)
    weights = {variables.fc1.weight: _shards(fc1.weight.detach().numpy().T, tp, 1),
               variables.fc1.bias: _shards(fc1.bias.detach().numpy(), tp, 0),
               variables.fc2.weight: _shards(fc2.weight.detach().numpy().T, tp, 0)}
    with ir.main_graph:
        stream = ipuxl.d2h_stream(y.shape, F32, "y")
        ops.host_store(stream, y)
    apply_pre_alias_patterns(ir)
    with ipuxl.Session(ir, "cpu") as session:
        session.write_variables_data(weights)
        got = session.run()[stream]
    want = fc2(torch.relu(fc1(torch.tensor(x_np)))).detach()
    for r in range(tp):
        assert_close(torch.tensor(got[r]), want, rtol=1e-5, atol=1e-5)


def test_vocab_sharded_embedding_matches_torch_values_and_gradients():
    vocab, hidden, tp = 40, 6, 2
    shard = Embedding.get_vocab_shard_size(vocab, tp)
    assert shard == 32 and list(Embedding.get_offsets(vocab, tp)) == [0, 32]  # ceil(40 / 2) rounded to 16
    table = rng.standard_normal((vocab, hidden)).astype(np.float32)
    padded = np.pad(table, ((0, shard * tp - vocab), (0, 0)))
    ids = np.array([0, 5, 31, 32, 39, 17], np.int32)
    dy = rng.standard_normal((len(ids), hidden)).astype(np.float32)
    ir = ipuxl.Ir(replication=tp)
    with ir.main_graph:
        rg = ir.replica_grouping(stride=tp, group_size=1)
        offset_ids = ipuxl.variable(np.stack([ids - o for o in Embedding.get_offsets(vocab, tp)]), ipuxl.int32,
                                    "ids", replica_grouping=rg)
        facts, graph = _EmbeddingModule(vocab, hidden, rg).create_graph(offset_ids)
        variables = facts.init()
        info = graph.bind(variables).call_with_info(offset_ids)
        grad = addons.autodiff(graph, grads_required=[graph.args.word.weight])
        (dw,) = grad.call(ipuxl.constant(dy), args=grad.grad_graph_info.inputs_dict(info))
    with ir.main_graph:
        streams = {n: ipuxl.d2h_stream(t.shape, F32, n) for n, t in (("y", info.outputs[0]), ("dw", dw))}
        ops.host_store(streams["y"], info.outputs[0])
        ops.host_store(streams["dw"], dw)
    apply_pre_alias_patterns(ir)
    with ipuxl.Session(ir, "cpu") as session:
        session.write_variables_data({variables.word.weight: _shards(padded, tp, 0)})
        got = session.run()
    t = torch.tensor(table, requires_grad=True)
    want = F.embedding(torch.tensor(ids, dtype=torch.long), t)
    want.backward(torch.tensor(dy))
    want_dw = np.pad(t.grad.numpy(), ((0, shard * tp - vocab), (0, 0)))
    for r in range(tp):
        assert_close(torch.tensor(got[streams["y"]][r]), want.detach())
        assert_close(got[streams["dw"]][r], _shards(want_dw, tp, 0)[r])


class _EmbeddingModule(addons.Module):
    def __init__(self, vocab, hidden, rg):
        super().__init__()
        self.rg = rg
        self.word = Embedding(F32, vocab, hidden, replica_grouping=rg)

    def build(self, ids):
        return replicated_all_reduce_identical_grad_inputs(self.word(ids), group=self.rg.transpose())


def test_distributed_layer_norm_matches_torch_with_gradients():
    """LayerNormDistributed normalises a hidden axis sharded over the TP group with the whole
    axis' statistics; its gradients are those of torch's layer norm, sharded."""
    n, hidden, tp = 5, 12, 3
    x_np = rng.standard_normal((n, hidden)).astype(np.float32) * 2 + 1
    w_np, b_np = rng.standard_normal(hidden).astype(np.float32), rng.standard_normal(hidden).astype(np.float32)
    dy_np = rng.standard_normal((n, hidden)).astype(np.float32)
    ir = ipuxl.Ir(replication=tp)
    with ir.main_graph:
        tp_group = ir.replica_grouping(group_size=tp)
        shard_rg = tp_group.transpose()
        x = ipuxl.variable(_shards(x_np, tp, 1), F32, "x", replica_grouping=shard_rg)
        dy = ipuxl.variable(_shards(dy_np, tp, 1), F32, "dy", replica_grouping=shard_rg)
        facts, graph = LayerNormDistributed(tp_group).create_graph(x)
        variables = facts.init()
        info = graph.bind(variables).call_with_info(x)
        grad = addons.autodiff(graph, grads_required=[graph.graph.inputs[0], *graph.args.tensors])
        outs = grad.call(dy, args=grad.grad_graph_info.inputs_dict(info))
    got = _run(ir, {"y": info.outputs[0], **{f"d{i}": t for i, t in enumerate(outs)}})
    assert variables.weight.shape == (hidden // tp,)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x_np, np.ones(hidden, np.float32),
                                                                 np.zeros(hidden, np.float32)))
    yt = F.layer_norm(xt, (hidden,), wt, bt, eps=1e-5)
    yt.backward(torch.tensor(dy_np))
    wanted = [xt.grad, bt.grad, wt.grad]  # grads_required: x, then the args sorted by name (bias, weight)
    for r in range(tp):
        assert_close(torch.tensor(got["y"][r]), yt.detach().chunk(tp, 1)[r], rtol=1e-5, atol=1e-5)
        for i, want in enumerate(wanted):
            assert_close(torch.tensor(got[f"d{i}"][r]), want.chunk(tp, -1)[r], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_sharded_cross_entropy_matches_torch(reduction):
    """Logits sharded over the class axis, labels offset per shard: the loss (the same on
    every shard) and each shard's logits gradient are torch's, ignore_index included."""
    n, classes, tp = 6, 8, 2
    logits_np = rng.standard_normal((n, classes)).astype(np.float32) * 3
    labels = np.array([0, 3, 4, 7, 5, 1], np.int32)
    ignored = 3
    dl_shape = () if reduction != "none" else (n,)
    dl_np = rng.standard_normal(dl_shape).astype(np.float32)
    per = classes // tp
    ir = ipuxl.Ir(replication=tp)
    with ir.main_graph:
        rg = ir.replica_grouping(group_size=1)
        logits = ipuxl.variable(_shards(logits_np, tp, 1), F32, "logits", replica_grouping=rg)
        offset = ipuxl.variable(np.stack([labels - i * per for i in range(tp)]), ipuxl.int32, "labels",
                                replica_grouping=rg)
        ignore = ipuxl.variable(np.array([ignored - i * per for i in range(tp)], np.int32), ipuxl.int32,
                                "ignore", replica_grouping=rg)
        graph = ir.create_graph(lambda lg, lb, ig: cross_entropy_sharded_loss(
            lg, lb, ig, replica_grouping=ir.replica_grouping(group_size=tp), reduction=reduction),
            logits, offset, ignore)
        info = ops.call_with_info(graph, logits, offset, ignore)
        grad = ipuxl.transforms.autodiff(graph, grads_required=[graph.inputs[0]])
        (dlogits,) = ops.call(grad.graph, ipuxl.constant(dl_np), inputs_dict=grad.inputs_dict(info))
    got = _run(ir, {"loss": info.outputs[0], "dlogits": dlogits})
    lt = torch.tensor(logits_np, requires_grad=True)
    want = F.cross_entropy(lt, torch.tensor(labels, dtype=torch.long), ignore_index=ignored, reduction=reduction)
    want.backward(torch.tensor(dl_np))
    for r in range(tp):
        assert_close(torch.tensor(got["loss"][r]), want.detach(), rtol=1e-5, atol=1e-5)
        assert_close(torch.tensor(got["dlogits"][r]), lt.grad.chunk(tp, 1)[r], rtol=1e-5, atol=1e-6)


def test_sharded_cross_entropy_refuses_an_unknown_reduction():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph, pytest.raises(InvalidValueError, match="`reduction` should be one of") as info:
        cross_entropy_sharded_loss(ipuxl.variable(np.zeros((2, 3), np.float32)),
                                   ipuxl.variable(np.zeros(2, np.int32)), reduction="max")  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


# -- the other ops of the applications ---------------------------------------------------------------
def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), -1).flatten(-2)


def test_rotary_embedding_matches_the_gptj_formula_with_gradients():
    """Rotating pairs (x[2i], x[2i+1]) by m * base^(-2i/d): GPT-J's ``x * cos + rotate(x) * sin``
    (interleaved tables); the rest of each head passes through."""
    b, s, heads, hh, rotary = 2, 5, 3, 8, 6
    x_np = rng.standard_normal((b, s, heads, hh)).astype(np.float32)
    dy_np = rng.standard_normal((b, s, heads, hh)).astype(np.float32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(x_np, name="x")
        sin, cos = trig_table_constants(s, rotary)
        graph = ir.create_graph(lambda t, si, co: rotary_pos_embed(t, si, co, rotary), x, sin, cos)
        info = ops.call_with_info(graph, x, sin, cos)
        grad = ipuxl.transforms.autodiff(graph, grads_required=[graph.inputs[0]])
        (dx,) = ops.call(grad.graph, ipuxl.constant(dy_np), inputs_dict=grad.inputs_dict(info))
    got = _run(ir, {"y": info.outputs[0], "dx": dx})
    sin_np, cos_np = trig_tables(s, rotary)
    sin_t = torch.tensor(np.repeat(sin_np, 2, -1))[None, :, None, :]
    cos_t = torch.tensor(np.repeat(cos_np, 2, -1))[None, :, None, :]
    xt = torch.tensor(x_np, requires_grad=True)
    rot = xt[..., :rotary]
    want = torch.cat((rot * cos_t + _rotate_every_two(rot) * sin_t, xt[..., rotary:]), -1)
    want.backward(torch.tensor(dy_np))
    assert_close(torch.tensor(got["y"][0]), want.detach(), rtol=1e-5, atol=1e-5)
    assert_close(torch.tensor(got["dx"][0]), xt.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [-1, 0])
def test_group_quantised_linear_uses_the_decompressed_weight(dim):
    """LinearGQ's weight, compressed on the host (upstream's numpy format), is decompressed on
    the device exactly as the host decompression; within a group step of the float weight."""
    d_in, d_out, group = 8, 16, 4
    x_np = rng.standard_normal((3, d_in)).astype(np.float16)
    linear = torch.nn.Linear(d_in, d_out).half()
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(x_np, ipuxl.float16, "x")
        facts, graph = LinearGQ(d_out, group_size=group, dim=dim).create_graph(x)
        variables = facts.init()
        (y,) = graph.bind(variables).call(x)
        stream = ipuxl.d2h_stream(y.shape, ipuxl.float16, "y")
        ops.host_store(stream, y)
    weights = LinearGQ.torch_mapping(variables, linear, ipuxl.float16, group_size=group, dim=dim)
    assert variables.weight_compressed.dtype == ipuxl.uint16
    with ipuxl.Session(ir, "cpu") as session:
        session.write_variables_data(weights)
        got = session.run()[stream]
    packed, scale, bias = group_quantize_compress_numpy(linear.weight.T.detach().numpy(), group, dim=dim)
    w = group_quantize_decompress_numpy(packed, scale, bias, dim)
    assert w.shape == (d_in, d_out)
    step = float(np.max(scale))
    np.testing.assert_allclose(w, linear.weight.T.detach().numpy(), atol=step / 2 + 1e-3)
    want = (torch.tensor(x_np, dtype=torch.float32) @ torch.tensor(w, dtype=torch.float32)
            + linear.bias.float()).detach()
    assert_close(torch.tensor(got, dtype=torch.float32), want, rtol=1e-2, atol=1e-2)  # float16 arithmetic


def test_grad_reduce_square_add_is_the_unscaled_squared_norm():
    g = rng.standard_normal((4, 5)).astype(np.float32) * 64
    ir = ipuxl.Ir()
    with ir.main_graph:
        out = grad_reduce_square_add(ipuxl.variable(g), loss_scaling=64)
    got = _run(ir, {"n": out})["n"][0]
    assert out.dtype == F32 and out.shape == ()
    assert_close(torch.tensor(got), torch.tensor((g / 64) ** 2).sum(), rtol=1e-5, atol=0)


# -- bad input ------------------------------------------------------------------------------------
def test_a_tp_grouping_that_does_not_divide_the_replicas_is_refused():
    ir = ipuxl.Ir(replication=4)
    with pytest.raises(ReplicationError, match=r"stride=1, group_size=3 does not divide the 4 replicas") as info:
        ir.replica_grouping(stride=1, group_size=3)  # a TP group of 3 on 4 replicas
    assert isinstance(info.value, ValueError) and "group_size among [1, 2, 4]" in info.value.fix
    with pytest.raises(ReplicationError, match="does not divide the 6 replicas"):
        ipuxl.Ir(replication=6).replica_grouping(stride=4, group_size=2)  # TP 4 x DP 2 on 6 replicas


def test_a_shard_of_the_wrong_shape_is_refused():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        rg = ir.replica_grouping(stride=2, group_size=1)
        facts, graph = Linear(3, replica_grouping=rg).create_graph(ipuxl.TensorSpec((2, 4), F32))
        variables = facts.init()
    with ipuxl.Session(ir, "cpu") as session, pytest.raises(ValueError, match="weight") as info:
        session.write_variables_data({variables.weight: np.zeros((4, 3), np.float32)})  # not (2 shards, 4, 3)
    assert "(2, 4, 3)" in str(info.value)
    with ir.main_graph, pytest.raises(ShapeMismatchError, match="must lead with the group dimension 2"):
        ipuxl.replica_sharded_buffer((4, 3), F32, replica_grouping=rg.transpose().transpose())


def test_distributed_layer_norm_and_rotary_refuse_bad_shapes():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((2, 3, 4), np.float32))
        with pytest.raises(ShapeMismatchError, match="needs t \\(N, H\\)"):
            LayerNormDistributed(ir.replica_grouping()).create_graph(x)
        sin, cos = trig_table_constants(3, 4)
        with pytest.raises(ShapeMismatchError, match="rotary_pos_embed"):
            rotary_pos_embed(x, sin, cos)  # 3-D: needs (batch, seq, heads, head_size)
