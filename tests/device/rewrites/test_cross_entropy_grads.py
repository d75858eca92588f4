"""``ipuxl.device.rewrites.cross_entropy_grads``: cross-entropy's gradient in one kernel (over the
log-softmax output when nothing reads it later), and training still matches eager PyTorch."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from ipuxl.device.rewrites import cross_entropy_grads, fuse_cross_entropy_grads
from ipuxl.kernels.losses import log_softmax_nll_grad
from tests.device.rewrites._training import train_like_eager

aten = torch.ops.aten


@pytest.fixture
def from_any_size(monkeypatch):
    """Rewrite losses of every size (by default only log-probabilities of ``MIN_BYTES`` or more)."""
    monkeypatch.setattr(cross_entropy_grads, "MIN_BYTES", 0)


class Classifier(nn.Module):
    """A language-model-like head: cross-entropy over many classes, ignored positions."""

    def __init__(self, width=16, classes=40):
        super().__init__()
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)
        self.loss = nn.CrossEntropyLoss(ignore_index=-100)

    def forward(self, x, labels):
        return self.loss(self.head(torch.tanh(self.body(x))), labels)


def test_cross_entropy_trains_like_eager_with_one_gradient_kernel(from_any_size):
    torch.manual_seed(0)
    model = Classifier()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * 3 * 8, 16, generator=gen)
    labels = torch.randint(0, 40, (2 * 3 * 8,), generator=gen)
    labels[::5] = -100
    code = train_like_eager(model, x, labels)
    assert re.findall(r"log_softmax_nll_grad\(.*\b(True|False)\)", code) == ["True"], code
    assert "nll_loss_backward" not in code and "_log_softmax_backward_data" not in code, code


def _graph(log_probs_from: str, later_view: bool = False, rank: int = 2) -> fx.Graph:
    """The gradient of ``nll_loss(log_probs)``; ``log_probs`` from ``_log_softmax`` ("op") or an input."""
    graph = fx.Graph()
    shape = (5, 7) if rank == 2 else (5, 7, 3)
    target_shape = (5,) if rank == 2 else (5, 3)
    g, t = graph.placeholder("g"), graph.placeholder("t")
    g.meta["val"], t.meta["val"] = torch.empty((), device="meta"), torch.empty(target_shape, dtype=torch.long,
                                                                                device="meta")
    if log_probs_from == "op":
        x = graph.placeholder("x")
        x.meta["val"] = torch.empty(shape, device="meta")
        lp = graph.call_function(aten._log_softmax.default, (x, 1, False))
    else:
        lp = graph.placeholder("lp")
    lp.meta["val"] = torch.empty(shape, device="meta")
    view = None
    if later_view:
        view = graph.call_function(aten.view.default, (lp, [-1]))
        view.meta["val"] = torch.empty(35 * (1 if rank == 2 else 3), device="meta")
    loss = graph.call_function(aten.nll_loss_forward.default, (lp, t, None, 1, -100))
    total = graph.call_function(lambda pair: pair[1], (loss,))
    total.meta["val"] = torch.empty((), device="meta")
    nll = graph.call_function(aten.nll_loss_backward.default, (g, lp, t, None, 1, -100, total))
    nll.meta["val"] = torch.empty(shape, device="meta")
    grad = graph.call_function(aten._log_softmax_backward_data.default, (nll, lp, 1, torch.float32))
    grad.meta["val"] = torch.empty(shape, device="meta")
    outputs = [grad] if view is None else [grad, graph.call_function(aten.clone.default, (view,))]
    graph.output(tuple(outputs))
    return graph


def _inputs(log_probs_from: str):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=gen)
    t = torch.tensor([1, -100, 6, 0, 1])
    return (torch.tensor(1.3), t, x if log_probs_from == "op" else torch.log_softmax(x, 1))


def _run(graph: fx.Graph, inputs):
    return fx.GraphModule(nn.Module(), graph)(*inputs)


def _fused(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.target is log_softmax_nll_grad]


def test_rewrite_writes_over_a_log_softmax_result_read_before(from_any_size):
    graph = _graph("op")
    want = _run(copy.deepcopy(graph), _inputs("op"))
    assert fuse_cross_entropy_grads(graph).modified
    assert [n.args[-1] for n in _fused(graph)] == [True]
    assert not [n for n in graph.nodes if n.target is aten.nll_loss_backward.default]
    torch.testing.assert_close(_run(graph, _inputs("op")), want)


def test_rewrite_leaves_inputs_and_later_read_views_unwritten(from_any_size):
    graph = _graph("input")
    inputs = _inputs("input")
    before = inputs[-1].clone()
    want = _run(copy.deepcopy(graph), inputs)
    assert fuse_cross_entropy_grads(graph).modified
    assert [n.args[-1] for n in _fused(graph)] == [False]
    torch.testing.assert_close(_run(graph, inputs), want)
    assert torch.equal(inputs[-1], before)  # the graph's input is not written
    graph = _graph("op", later_view=True)  # a view of the log-probabilities, read after the gradient
    want = _run(copy.deepcopy(graph), _inputs("op"))
    assert fuse_cross_entropy_grads(graph).modified
    assert [n.args[-1] for n in _fused(graph)] == [False]
    torch.testing.assert_close(_run(graph, _inputs("op")), want)


def test_rewrite_leaves_other_shapes_and_shared_nll_gradients_alone(from_any_size):
    assert not fuse_cross_entropy_grads(_graph("op", rank=3)).modified  # nll_loss2d-like: 3-D
    graph = _graph("op")
    nll = next(n for n in graph.nodes if n.target is aten.nll_loss_backward.default)
    out = next(n for n in graph.nodes if n.op == "output")
    out.args = ((*out.args[0], nll),)  # the nll gradient has another reader
    assert not fuse_cross_entropy_grads(graph).modified


def test_small_losses_keep_aten_kernels_bit_for_bit_eager():
    graph = _graph("op")  # 5 x 7 log-probabilities: far below MIN_BYTES
    assert cross_entropy_grads.MIN_BYTES == 32 << 20
    assert not fuse_cross_entropy_grads(graph).modified
    big = copy.deepcopy(graph)
    for node in big.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and tuple(val.shape) == (5, 7):
            node.meta["val"] = torch.empty(4096, 2048, device="meta")  # 32 MiB of float32
    assert fuse_cross_entropy_grads(big).modified
