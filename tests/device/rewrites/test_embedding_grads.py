"""``ipuxl.device.rewrites.embedding_grads``: a tied or twice-read embedding's gradient is added
into the other gradient without table-sized zeros, and training still matches eager PyTorch."""
from __future__ import annotations

import copy
import re

import torch
import torch.fx as fx
import torch.nn as nn

from ipuxl.device.rewrites import fuse_embedding_grads
from ipuxl.kernels.embedding import add_embedding_grad
from tests.device.rewrites._training import train_like_eager

aten = torch.ops.aten


class TiedLM(nn.Module):
    """Token embedding tied to the output head (as GPT-2's), read for two inputs (as T5's
    encoder and decoder), with a padding token."""

    def __init__(self, vocab=50, width=16, padding_idx=0):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=padding_idx)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.loss = nn.CrossEntropyLoss()

    def forward(self, source, target):
        h = torch.tanh(self.mix(self.embed(source) + self.embed(target).mean(1, keepdim=True)))
        logits = self.head(h)
        return self.loss(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def test_tied_embedding_trains_like_eager_without_dense_embedding_gradients():
    torch.manual_seed(0)
    model = TiedLM()
    gen = torch.Generator().manual_seed(1)
    source = torch.randint(0, 50, (3 * 4, 7), generator=gen)
    target = torch.randint(0, 50, (3 * 4, 7), generator=gen)
    source[::2, -2:] = 0  # padding tokens, whose rows get no gradient
    code = train_like_eager(model, source, target)
    # the head's gradient, then the two readings' token rows added into it, in place
    assert re.findall(r"add_embedding_grad\([^)]*\b(True|False)\)", code) == ["True", "True"], code
    assert "embedding_dense_backward" not in code, code


def _graph(other_is_fresh: bool) -> fx.Graph:
    """``x + embedding_dense_backward(g, ids, 10, 0, False)``, ``x`` a matmul's result or an input."""
    graph = fx.Graph()
    g, ids, a, b = (graph.placeholder(n) for n in ("g", "ids", "a", "b"))
    metas = ((g, torch.empty(4, 6)), (ids, torch.empty(4, dtype=torch.long)), (a, torch.empty(10, 3)),
             (b, torch.empty(3, 6)))
    for node, meta in metas:
        node.meta["val"] = meta.to("meta")
    if other_is_fresh:
        x = graph.call_function(aten.mm.default, (a, b))
        x.meta["val"] = torch.empty(10, 6, device="meta")
    else:
        x = graph.placeholder("x")
        x.meta["val"] = torch.empty(10, 6, device="meta")
    dense = graph.call_function(aten.embedding_dense_backward.default, (g, ids, 10, 0, False))
    dense.meta["val"] = torch.empty(10, 6, device="meta")
    total = graph.call_function(torch.add, (dense, x))
    total.meta["val"] = torch.empty(10, 6, device="meta")
    graph.output(total)
    return graph


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(4, 6, generator=gen), torch.tensor([0, 2, 2, 9]), torch.randn(10, 3, generator=gen),
            torch.randn(3, 6, generator=gen))


def test_rewrite_adds_into_a_fresh_matmul_result_in_place():
    graph = _graph(other_is_fresh=True)
    want = fx.GraphModule(nn.Module(), copy.deepcopy(graph))(*_inputs())
    assert fuse_embedding_grads(graph).modified
    fused = [n for n in graph.nodes if n.target is add_embedding_grad]
    assert len(fused) == 1 and fused[0].args[-1] is True and fused[0].args[3] == 0
    assert not [n for n in graph.nodes if n.target is aten.embedding_dense_backward.default]
    torch.testing.assert_close(fx.GraphModule(nn.Module(), graph)(*_inputs()), want)


def test_rewrite_adds_into_a_copy_of_a_tensor_it_does_not_own():
    graph = _graph(other_is_fresh=False)
    inputs = (*_inputs(), torch.randn(10, 6))
    before = inputs[-1].clone()
    want = fx.GraphModule(nn.Module(), copy.deepcopy(graph))(*inputs)
    assert fuse_embedding_grads(graph).modified
    assert [n.args[-1] for n in graph.nodes if n.target is add_embedding_grad] == [False]
    torch.testing.assert_close(fx.GraphModule(nn.Module(), graph)(*inputs), want)
    assert torch.equal(inputs[-1], before)  # the graph's input is not written


def test_rewrite_leaves_frequency_scaled_and_broadcast_sums_alone():
    graph = _graph(other_is_fresh=True)
    dense = next(n for n in graph.nodes if n.target is aten.embedding_dense_backward.default)
    dense.args = (*dense.args[:4], True)  # scale_grad_by_freq
    assert not fuse_embedding_grads(graph).modified
    graph = _graph(other_is_fresh=True)
    mm = next(n for n in graph.nodes if n.target is aten.mm.default)
    mm.meta["val"] = torch.empty(1, 6, device="meta")  # a broadcast addition
    assert not fuse_embedding_grads(graph).modified
