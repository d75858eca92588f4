"""Device compilation of captured (``trainingModel``) programs: the generated code is
lean and still trains exactly like eager PyTorch (the oracle).

Structural checks on the generated Python of the main program and the graphs it
calls (``_code``: the device loop's step is a compiled loop body):

* a captured Linear's weight gradient, ``t(t(mm(a, g)))`` in ``make_fx``'s trace,
  is fused into its SGD update as one ``addmm_`` (``device.fuse``);
* the learning rate is negated once per param group per step (``optim.rules``);
* ``nll_loss_forward`` runs once per step (``passes.autodiff`` keeps its second
  result, ``total_weight``, in the forward);
* max pooling runs through ``device.fuse.max_pool2d_with_indices`` (the channels-last
  kernel), which gives bit for bit the values and indices of the NCHW kernel;
* convolution gradients run through ``device.fuse.convolution_backward``, which computes
  small pointwise convolutions' gradients and small-output weight gradients as GEMMs,
  5x5-and-larger depthwise weight gradients as a convolution
  and then the bias gradient as a sum (checked against aten in float64, every output mask);
* an SGD momentum update of a matmul gradient is one GEMM into the buffer (``scaled_addmm_``),
  and a momentum step of any other gradient one pass (``sgd_momentum_step_``, bit for bit eager).
"""
from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import ipuxl
import ipuxl.ops as ops
from ipuxl.device import fuse
from ipuxl.device.fuse import convolution_backward, fold_inverse_transposes, max_pool2d_with_indices
from ipuxl.optim import rules

TOL = dict(rtol=1e-5, atol=1e-6)
aten = torch.ops.aten


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 5)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, self.loss(out, y)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3), nn.Conv2d(8, 16, 3)
        self.pool, self.fc = nn.MaxPool2d(2), nn.Linear(16 * 2 * 2, 4)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        x = torch.relu(self.pool(self.conv1(x)))
        x = torch.relu(self.pool(self.conv2(x)))
        out = self.fc(x.view(-1, 64))
        return out, self.loss(out, y)


def _train(model: nn.Module, make_opt, x: torch.Tensor, y: torch.Tensor, n: int):
    """(ipuxl executor, eager copy) after one call of n steps on each side."""
    torch.manual_seed(0)
    eager = copy.deepcopy(model)
    eager_opt = make_opt(eager)
    ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(n), optimizer=make_opt(model))
    _, loss = ipu(x, y)
    for xs, ys in zip(x.chunk(n), y.chunk(n)):
        eager_opt.zero_grad()
        _, ref_loss = eager(xs, ys)
        ref_loss.backward()
        eager_opt.step()
    ipu.copyWeightsToHost()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m, n=name: f"{n}: {m}", **TOL)
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    return ipu, eager


def _data(shape, batch, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)


def _calls(code: str, name: str) -> int:
    return len(re.findall(rf"\b{name}\(", code))


def _code(session: ipuxl.Session) -> str:
    """The generated code of the main program and of every compiled called graph."""
    compiled = [session.compiled_graph(g) for g in session.ir.graphs]
    return "\n".join([session.code] + [c.module.code for c in compiled if c is not None])


def test_captured_linear_weight_updates_are_fused_into_addmm():
    torch.manual_seed(0)
    x, y = _data((12,), 4 * 6, 5)
    ipu, _ = _train(MLP(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), x, y, n=4)
    code = _code(ipu.session)
    assert _calls(code, "torch_Tensor_addmm_") == 2, code  # fc1.weight and fc2.weight
    assert _calls(code, "torch_Tensor_addcmul_") == 2, code  # the biases
    # no transpose of a transpose is left
    transposed = set(re.findall(r"(\w+) = torch\.ops\.aten\.t\.default\((\w+)\)", code))
    names = {out for out, _ in transposed}
    assert not [src for _, src in transposed if src in names], code


def test_learning_rate_is_negated_once_per_group():
    torch.manual_seed(0)
    x, y = _data((12,), 3 * 4, 5)

    def groups(m):
        return torch.optim.SGD([{"params": m.fc1.parameters(), "lr": 0.05}, {"params": m.fc2.parameters()}], lr=0.1)

    ipu, _ = _train(MLP(), groups, x, y, n=3)
    assert _calls(_code(ipu.session), "torch.neg") == 2, _code(ipu.session)


def test_nll_loss_forward_runs_once_per_step():
    torch.manual_seed(0)
    x, y = _data((12,), 4, 5)
    ipu, _ = _train(MLP(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), x, y, n=1)
    assert _calls(_code(ipu.session), "torch.ops.aten.nll_loss_forward.default") == 1, _code(ipu.session)


def test_cnn_max_pool_uses_the_channels_last_kernel_and_trains_like_eager():
    torch.manual_seed(0)
    x, y = _data((1, 14, 14), 3 * 4, 4)
    ipu, _ = _train(CNN(), lambda m: torch.optim.SGD(m.parameters(), lr=0.05), x, y, n=3)
    code = _code(ipu.session)
    assert _calls(code, "ipuxl_device_fuse_max_pool2d_with_indices") == 2, code
    assert _calls(code, "torch.ops.aten.max_pool2d_with_indices.default") == 0, code
    assert _calls(code, "torch.neg") == 1 and _calls(code, "torch_Tensor_addmm_") == 1, code


@pytest.mark.parametrize("shape,args", [
    ((2, 16, 9, 9), ([2, 2], [2, 2])),
    ((2, 8, 10, 7), ([3, 3], [2, 2], [1, 1], [1, 1], True)),  # overlapping windows, padding, ceil
    ((1, 32, 6, 6), ([2, 3], [1, 2], [0, 1], [2, 1])),  # dilation
    ((2, 3, 6, 6), ([2, 2], [2, 2])),  # few channels: the NCHW kernel itself
])
def test_max_pool_helper_is_bitwise_the_aten_kernel(shape, args):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, shape, generator=g).float()  # many ties
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = float("-inf")
    want = aten.max_pool2d_with_indices.default(x, *args)
    got = max_pool2d_with_indices(x, *args)
    for a, b in zip(got, want):
        assert a.stride() == b.stride() and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _graph(build) -> fx.Graph:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, 3, 4, device="meta")
    out = build(graph, x)
    graph.output(out)
    return graph


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
    return node


def test_fold_inverse_transposes():
    def build(graph, x):
        p = _call(graph, aten.permute.default, x, [2, 0, 1])
        back = _call(graph, aten.permute.default, p, [1, 2, 0])  # undoes p
        tr = _call(graph, aten.transpose.int, x, 0, -1)
        tr_back = _call(graph, aten.transpose.int, tr, 2, 0)
        same = _call(graph, aten.permute.default, p, [2, 0, 1])  # does not undo p
        total = _call(graph, aten.add.Tensor, back, tr_back)
        return (_call(graph, aten.add.Tensor, total, _call(graph, aten.sum.default, same)), back)

    graph = _graph(build)
    x = torch.randn(2, 3, 4)
    want = fx.GraphModule(torch.nn.Module(), copy.deepcopy(graph))(x)
    assert fold_inverse_transposes(graph)
    adds = [n for n in graph.nodes if n.target is aten.add.Tensor]
    assert [a.name for a in adds[0].args] == ["x", "x"]
    assert not [n for n in graph.nodes if n.target is aten.transpose.int]
    assert len([n for n in graph.nodes if n.target is aten.permute.default]) == 3  # p, same, back (an output)
    got = fx.GraphModule(torch.nn.Module(), graph)(x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not fold_inverse_transposes(graph)


def test_negated_learning_rate_is_not_reused_after_the_rate_is_written():
    ir = ipuxl.Ir()
    with ir.main_graph:
        lr = ipuxl.variable(np.float32(0.5), ipuxl.float32, name="lr")
        w1 = ipuxl.variable(np.ones(3, np.float32), ipuxl.float32, name="w1")
        w2 = ipuxl.variable(np.ones(3, np.float32), ipuxl.float32, name="w2")
        w3 = ipuxl.variable(np.ones(3, np.float32), ipuxl.float32, name="w3")
        g = ipuxl.constant(np.full(3, 2.0, np.float32), ipuxl.float32)
        rules.sgd_(w1, g, lr=lr)
        rules.sgd_(w2, g, lr=lr)  # reuses -lr
        ops.var_updates.copy_var_update_(lr, ipuxl.constant(np.float32(0.25), ipuxl.float32))
        rules.sgd_(w3, g, lr=lr)  # lr changed: negated again
    negs = [n for n in ir.main_graph.fx.nodes if n.target is torch.neg]
    assert len(negs) == 2
    with ipuxl.Session(ir, "cpu") as session:
        session.run()
        got = session.get_tensors_data([w1, w2, w3])
    np.testing.assert_array_equal(got[w1], np.zeros(3, np.float32))
    np.testing.assert_array_equal(got[w2], np.zeros(3, np.float32))
    np.testing.assert_array_equal(got[w3], np.full(3, 0.5, np.float32))


# (batch, channels, h, w, out channels, kernel, stride, padding, dilation, groups)
CONVOLUTIONS = [
    (4, 32, 2, 2, 16, 3, 1, 1, 1, 1),  # 16 output positions: the GEMM weight gradient
    (4, 16, 4, 4, 24, 3, 2, 1, 1, 1),  # strided down to 2x2
    (2, 16, 2, 2, 8, 1, 1, 0, 1, 1),  # 1x1
    (1, 6, 6, 6, 4, 3, 2, 2, 2, 1),  # dilated, padded
    (4, 24, 2, 2, 24, 7, 1, 3, 1, 24),  # depthwise 7x7: the weight gradient as a convolution
    (2, 12, 9, 9, 12, 5, 2, 2, 1, 12),  # depthwise 5x5, strided
    (3, 8, 11, 10, 8, 5, 2, 4, 2, 8),  # depthwise, strided and dilated (taps cropped)
    (2, 8, 9, 9, 16, 3, 1, 1, 1, 2),  # grouped: aten's gradients
    (2, 8, 12, 12, 16, 3, 1, 1, 1, 1),  # large output: aten's weight gradient
    (4, 24, 8, 8, 40, 1, 1, 0, 1, 1),  # small pointwise: both gradients as GEMMs
    (2, 64, 16, 16, 128, 1, 1, 0, 1, 1),  # large pointwise: aten's
]
MASKS = [[True, True, True], [False, True, True], [True, True, False], [False, True, False], [True, False, True],
         [False, False, True], [True, False, False]]


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("conv", CONVOLUTIONS, ids=str)
def test_convolution_backward_equals_aten(conv, channels_last):
    n, c, h, w, k, r, stride, pad, dil, groups = conv
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, c, h, w, dtype=torch.float64, generator=gen)
    weight = torch.randn(k, c // groups, r, r, dtype=torch.float64, generator=gen)
    if channels_last:
        x, weight = (t.contiguous(memory_format=torch.channels_last) for t in (x, weight))
    grad = torch.randn_like(torch.nn.functional.conv2d(x, weight, None, stride, pad, dil, groups))
    for mask in MASKS:
        args = (grad, x, weight, [k], [stride] * 2, [pad] * 2, [dil] * 2, False, [0, 0], groups, mask)
        want, got = aten.convolution_backward.default(*args), convolution_backward(*args)
        for i, (a, b) in enumerate(zip(want, got)):
            assert (a is None) == (b is None) == (not mask[i])
            if a is not None:
                torch.testing.assert_close(b, a, msg=lambda m, i=i, mask=mask: f"output {i} of mask {mask}: {m}")
                assert b.shape == a.shape and b.dtype == a.dtype


def test_convolution_backward_paths(monkeypatch):
    """Which weight gradient each convolution gets (the speed rules of ``device.fuse``)."""
    picked = []
    for name in ("_weight_gradient_gemm", "_weight_gradient_depthwise", "_pointwise_backward"):
        real = getattr(fuse, name)
        monkeypatch.setattr(fuse, name, lambda *a, real=real, name=name: picked.append(name) or real(*a))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the rules for several threads
    for conv in CONVOLUTIONS:
        n, c, h, w, k, r, stride, pad, dil, groups = conv
        x, weight = torch.randn(n, c, h, w), torch.randn(k, c // groups, r, r)
        grad = torch.randn_like(torch.nn.functional.conv2d(x, weight, None, stride, pad, dil, groups))
        convolution_backward(grad, x, weight, [k], [stride] * 2, [pad] * 2, [dil] * 2, False, [0, 0], groups,
                             [True, True, True])
    assert picked == ["_weight_gradient_gemm"] * 4 + ["_weight_gradient_depthwise"] * 3 + ["_pointwise_backward"]


class SmallEnd(nn.Module):
    """A CNN whose last stage is 2x2 (GEMM weight gradients) with a depthwise 5x5 conv with a bias."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.depthwise = nn.Conv2d(32, 32, 5, padding=2, groups=32)
        self.head = nn.Linear(32, 5)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        x = torch.relu(self.down(torch.relu(self.stem(x))))
        out = self.head(torch.relu(self.depthwise(x)).mean((2, 3)))
        return out, self.loss(out, y)


def test_small_output_and_depthwise_convolutions_train_like_eager():
    x, y = _data((3, 8, 8), 4 * 3, 5)
    ipu, _ = _train(SmallEnd(), lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), x, y, n=3)
    assert _calls(_code(ipu.session), "ipuxl_device_fuse_convolution_backward") == 3, _code(ipu.session)


def test_momentum_update_of_a_matmul_gradient_is_one_gemm_and_trains_like_eager():
    x, y = _data((12,), 4 * 5, 5)
    ipu, _ = _train(MLP(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), x, y, n=5)
    code = _code(ipu.session)
    assert _calls(code, "ipuxl_kernels_var_updates_scaled_addmm_") == 2, code  # fc1.weight, fc2.weight
    assert _calls(code, "torch.ops.aten.mm.default") == 1, code  # fc2's input gradient only


def test_sgd_momentum_steps_are_one_fused_pass_bit_for_bit_eager():
    torch.manual_seed(0)
    x, y = _data((1, 14, 14), 3 * 4, 4)
    model = CNN()
    eager = copy.deepcopy(model)
    ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(3),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        ipu(x, y)
        for xs, ys in zip(x.chunk(3), y.chunk(3)):
            eager_opt.zero_grad()
            eager(xs, ys)[1].backward()
            eager_opt.step()
    ipu.copyWeightsToHost()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    code = _code(ipu.session)
    # conv1, conv2 (weights and biases) and fc's bias; fc's weight takes scaled_addmm_
    assert _calls(code, "ipuxl_kernels_var_updates_sgd_momentum_step_") == 5, code
    assert _calls(code, "ipuxl_kernels_var_updates_scaled_addmm_") == 1, code


def test_sgd_momentum_step_kernel_matches_the_unfused_steps():
    from ipuxl.kernels import var_updates
    from ipuxl.kernels.var_updates import sgd_momentum_step_

    gen = torch.Generator().manual_seed(0)
    big = var_updates.FUSED_SGD_MIN_ELEMENTS
    for dtype, numel in ((torch.float32, big + 65), (torch.float32, 4), (torch.float32, big), (torch.float64, big + 3),
                         (torch.float16, big + 1)):  # big + 65: the fused kernel's big + 64, an unfused tail
        w, buf, grad = (torch.randn(numel, generator=gen).to(dtype) for _ in range(3))
        for momentum, negative_lr in ((torch.tensor(0.9), torch.tensor(-0.01)), (0.5, -0.1)):
            want_w, want_buf = w.clone(), buf.clone()
            want_buf.mul_(momentum).add_(grad)
            if isinstance(negative_lr, torch.Tensor):  # the unfused update, as optim.rules emits it
                want_w.addcmul_(want_buf, negative_lr)
            else:
                want_w.add_(want_buf, alpha=negative_lr)
            got_w, got_buf = w.clone(), buf.clone()
            sgd_momentum_step_(got_w, got_buf, grad, momentum, negative_lr)  # float16: the unfused steps
            torch.testing.assert_close(got_buf, want_buf, rtol=0, atol=0)
            torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)
