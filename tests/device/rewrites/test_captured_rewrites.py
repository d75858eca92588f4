"""Device rewrites (``ipuxl.device.rewrites``) on captured (``trainingModel``) programs: the
generated code is lean and still trains exactly like eager PyTorch (the oracle).

Structural checks on the generated Python of the main program and the graphs it
calls (``_code``: the device loop's step is a compiled loop body):

* a captured Linear's weight gradient, ``t(t(mm(a, g)))`` in ``make_fx``'s trace,
  is fused into its SGD update as one ``addmm_`` (``rewrites.matmul_updates``);
* the learning rate is negated once per param group per step (``optim.rules``);
* ``nll_loss_forward`` runs once per step (``passes.autodiff`` keeps its second
  result, ``total_weight``, in the forward);
* max pooling runs through ``kernels.pool.max_pool2d_with_indices`` (the channels-last
  kernel; ``rewrites.kernel_choice``);
* convolution gradients run through ``kernels.conv.convolution_backward``
  (``rewrites.kernel_choice``; the kernels themselves: ``tests/kernels``);
* an SGD momentum update of a matmul gradient is one GEMM into the buffer (``scaled_addmm_``),
  and a momentum step of any other gradient one pass (``sgd_momentum_step_``, bit for bit eager).
"""
from __future__ import annotations

import copy
import re

import numpy as np
import torch
import torch.nn as nn

import ipuxl
import ipuxl.ops as ops
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
    step = next(g for g in ipu.session.ir.graphs if ipu.session.compiled_graph(g) is not None)
    assert "fuse_matmul_updates" in ipu.session.compiled_graph(step).rewrites
    assert ipu.session.applied_rewrites[step] == ipu.session.compiled_graph(step).rewrites
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
    assert _calls(code, "ipuxl_kernels_pool_max_pool2d_with_indices") == 2, code
    assert _calls(code, "torch.ops.aten.max_pool2d_with_indices.default") == 0, code
    assert _calls(code, "torch.neg") == 1 and _calls(code, "torch_Tensor_addmm_") == 1, code


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
    assert _calls(_code(ipu.session), "ipuxl_kernels_conv_convolution_backward") == 3, _code(ipu.session)


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
