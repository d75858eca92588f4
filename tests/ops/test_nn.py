"""The nn ops (``ipuxl.ops.nn``: matmul, softmax, normalisations, nll losses), forward and gradient,
against eager PyTorch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import InvalidArgumentError

from ._harness import case, ints, pos, randn, run_case


MATMUL = [
    case("2d", ops.matmul, torch.matmul, (3, 4), (4, 5)),
    case("batched", ops.matmul, torch.matmul, (2, 3, 4), (2, 4, 5)),
    case("batched-rhs-2d", ops.matmul, torch.matmul, (2, 3, 4), (4, 5)),
    case("broadcast", ops.matmul, torch.matmul, (2, 1, 3, 4), (5, 4, 2)),
    case("vec-mat", ops.matmul, torch.matmul, (4,), (4, 3)),
    case("mat-vec", ops.matmul, torch.matmul, (3, 4), (4,)),
    case("output_type", lambda a, b: ops.matmul(a, b, output_type=ipuxl.float32),
         lambda a, b: (a @ b).float(), (3, 4), (4, 5), atol=1e-6, rtol=1e-6),
    case("operator", lambda a, b: a @ b, torch.matmul, (3, 4), (4, 2)),
    case("grad-rhs-only", ops.matmul, torch.matmul, (3, 4), (4, 2), grad_inputs=[1]),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", MATMUL)
def test_matmul(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def _layer_norm_ref(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


NN = [
    case("softmax-last", lambda x: ops.softmax(x, -1), lambda x: torch.softmax(x, -1), (3, 5)),
    case("softmax-0", lambda x: ops.softmax(x, 0), lambda x: torch.softmax(x, 0), (3, 5)),
    case("softmax-3d", lambda x: ops.softmax(x, 1), lambda x: torch.softmax(x, 1), (2, 3, 4)),
    case("log_softmax-last", lambda x: ops.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1), (3, 5)),
    case("log_softmax-0", lambda x: ops.log_softmax(x, 0), lambda x: torch.log_softmax(x, 0), (2, 3, 4)),
    case("layer_norm", ops.layer_norm, _layer_norm_ref, (4, 6), (6,), (6,)),
    case("layer_norm-3d-eps", lambda x, w, b: ops.layer_norm(x, w, b, epsilon=1e-2),
         lambda x, w, b: _layer_norm_ref(x, w, b, 1e-2), (2, 3, 5), (5,), (5,)),
    case("conv", ops.conv, F.conv2d, (2, 3, 6, 6), (4, 3, 3, 3)),
    case("conv-stride-pad-dilation", lambda x, w: ops.conv(x, w, (2, 1), (1, 2, 1, 2), (1, 2)),
         lambda x, w: F.conv2d(x, w, None, (2, 1), (1, 2), (1, 2)), (2, 3, 7, 8), (4, 3, 3, 3)),
    case("conv-groups", lambda x, w: ops.conv(x, w, groups=2), lambda x, w: F.conv2d(x, w, groups=2),
         (1, 4, 5, 5), (6, 2, 2, 2)),
    case("max_pool", lambda x: ops.max_pool(x, (2, 2)), lambda x: F.max_pool2d(x, (2, 2), 1), (2, 3, 6, 6)),
    case("max_pool-stride", lambda x: ops.max_pool(x, (3, 2), (1, 2)),
         lambda x: F.max_pool2d(x, (3, 2), (1, 2)), (1, 2, 6, 6)),
    case("average_pool", lambda x: ops.average_pool(x, (2, 2)), lambda x: F.avg_pool2d(x, (2, 2), 1),
         (2, 3, 6, 6)),
    case("average_pool-stride", lambda x: ops.average_pool(x, (3, 3), (2, 1)),
         lambda x: F.avg_pool2d(x, (3, 3), (2, 1)), (1, 2, 7, 6)),
]


NN += [
    case("group_norm", lambda x, w, b: ops.group_norm(x, w, b, 2), lambda x, w, b: F.group_norm(x, 2, w, b),
         (2, 4, 3, 3), (4,), (4,)),
    case("group_norm-2d-eps", lambda x, w, b: ops.group_norm(x, w, b, 1, eps=1e-2),
         lambda x, w, b: F.group_norm(x, 1, w, b, 1e-2), (3, 6), (6,), (6,)),
    case("batch_norm_inference",
         lambda x, s, b, m, v: ops.batch_norm_inference(x, s, b, m, v, 1e-3),
         lambda x, s, b, m, v: (x - m[:, None, None]) / torch.sqrt(v[:, None, None] + 1e-3) * s[:, None, None]
         + b[:, None, None], (2, 3, 2, 2), (3,), (3,), (3,), pos((3,))),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", NN)
def test_nn(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def _nll_ref(probs, labels, ignore_index=None, reduction="mean", log_prob=False):
    """PopXL's NLL from the documented formula: ``-log(max(p, 1e-7))`` of the label's probability.

    Ignored labels contribute 0 and, for ``"mean"``, are not counted.
    """
    classes = probs.shape[-1]
    logp = probs if log_prob else torch.log(torch.clamp(probs, min=1e-7))
    flat = F.nll_loss(logp.reshape(-1, classes), labels.reshape(-1).long(),
                      ignore_index=-100 if ignore_index is None else ignore_index, reduction=reduction)
    return flat.reshape(labels.shape) if reduction == "none" else flat


def _probs(shape, seed=0, zero_at=None):
    p = np.random.default_rng(seed).random(shape) + 0.05
    p /= p.sum(-1, keepdims=True)
    if zero_at is not None:
        p[zero_at] = 0.0  # clamped to 1e-7 in the loss, no gradient
    return p


_labels = np.array([0, 2, 1, 2, 3], np.int32)


NLL = [
    case(f"{reduction}{'-ignore' if ignore is not None else ''}",
         lambda p, l, r=reduction, i=ignore: ops.nll_loss(p, l, ignore_index=i, reduction=r),
         lambda p, l, r=reduction, i=ignore: _nll_ref(p, l, i, r),
         _probs((5, 4), zero_at=(0, 0)), _labels)
    for reduction in ("mean", "sum", "none") for ignore in (None, 2)
]

NLL += [
    case("mean-3d-labels", lambda p, l: ops.nll_loss(p, l), lambda p, l: _nll_ref(p, l),
         _probs((2, 3, 4), 1), ints((2, 3), 0, 4)),
    case("none-3d-labels-ignore", lambda p, l: ops.nll_loss(p, l, ignore_index=1, reduction="none"),
         lambda p, l: _nll_ref(p, l, 1, "none"), _probs((2, 3, 4), 2), ints((2, 3), 0, 4, seed=3)),
    case("log_prob", lambda p, l: ops.nll_loss(p, l, log_prob=True), lambda p, l: _nll_ref(p, l, log_prob=True),
         np.log(_probs((5, 4), 3)), _labels),
    case("log_prob-ignored-minus-inf", lambda p, l: ops.nll_loss(p, l, 1, "mean", log_prob=True),
         lambda p, l: _nll_ref(p, l, 1, "mean", log_prob=True), np.array([[-np.inf, -0.1], [-1.0, -0.5]]),
         np.array([1, 0], np.int32)),
    case("log_prob-sum-ignore", lambda p, l: ops.nll_loss(p, l, 3, "sum", log_prob=True),
         lambda p, l: _nll_ref(p, l, 3, "sum", log_prob=True), np.log(_probs((5, 4), 4)), _labels),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", NLL)
def test_nll_loss(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def _nll_softmax_ref(x, labels, loss_grad=1.0, ignore_index=None, reduction="mean"):
    """Loss of ``softmax(x)`` and the autograd gradient of ``loss_grad * loss`` w.r.t. ``x``."""
    x = x.detach().requires_grad_(True)
    loss = _nll_ref(torch.softmax(x, -1), labels, ignore_index, reduction)
    (dx,) = torch.autograd.grad(loss, x, torch.ones_like(loss) * loss_grad)
    return loss.detach(), dx


NLL_SOFTMAX = [
    case(f"{reduction}{'-ignore' if ignore is not None else ''}-lossgrad{lg}",
         lambda x, l, r=reduction, i=ignore, lg=lg: ops.nll_loss_with_softmax_grad(
             ops.softmax(x, -1), l, loss_grad=lg, ignore_index=i, reduction=r),
         lambda x, l, r=reduction, i=ignore, lg=lg: _nll_softmax_ref(x, l, lg, i, r),
         randn((5, 4), seed=7), _labels, grad=False)
    for reduction in ("mean", "sum", "none") for ignore in (None, 2) for lg in (1, 0.25)
]

NLL_SOFTMAX += [
    case("mean-3d", lambda x, l: ops.nll_loss_with_softmax_grad(ops.softmax(x, -1), l),
         lambda x, l: _nll_softmax_ref(x, l), randn((2, 3, 4), seed=8), ints((2, 3), 0, 4), grad=False),
    case("loss_grad-tensor", lambda x, l, g: ops.nll_loss_with_softmax_grad(ops.softmax(x, -1), l, g),
         lambda x, l, g: _nll_softmax_ref(x, l, g), randn((5, 4), seed=9), _labels, np.array(0.5), grad=False),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", NLL_SOFTMAX)
def test_nll_loss_with_softmax_grad(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def test_nll_loss_rejects_unknown_reduction():
    ir = ipuxl.Ir()
    with ir.main_graph, pytest.raises(InvalidArgumentError, match="reduction"):
        p = ipuxl.variable(np.ones((2, 3), np.float32))
        ops.nll_loss(p, ipuxl.variable(np.zeros((2,), np.int32)), reduction="avg")


def test_group_norm_groups_must_divide_the_channels():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.zeros((1, 2, 3, 3), np.float32), name="x")
        with pytest.raises(ValueError, match="groups do not divide"):
            ops.group_norm(x, x, x, 3)
