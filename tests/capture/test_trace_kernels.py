"""The captured step runs eager's kernels (issue #16): fused batch norm, folded matmuls,
no copies of transposed weights; and the device keeps its freed memory.

Each test checks the compiled program (what ran) and that training still gives
eager's numbers (weights, buffers and outputs after several SGD steps)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import ipuxl
from ipuxl import Options

TOL = dict(rtol=1e-5, atol=1e-6)


class WithLoss(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        out = self.net(x)
        return out, nn.functional.cross_entropy(out, y)


def train_both(net: nn.Module, x: torch.Tensor, y: torch.Tensor, calls: int = 3, iterations: int = 2,
               momentum: float = 0.9):
    """``calls`` calls of ``iterations`` SGD steps through ``trainingModel`` and eagerly
    (same weights and data); returns (training model, its module, eager module)."""
    model, ref = WithLoss(net), WithLoss(copy.deepcopy(net))
    training = ipuxl.trainingModel(model, Options().deviceIterations(iterations),
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=momentum)
    micro = x.shape[0] // iterations
    for _ in range(calls):
        out, _ = training(x, y)
        for i in range(iterations):
            ref_opt.zero_grad()
            ref_out, loss = ref(x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro])
            loss.backward()
            ref_opt.step()
        torch.testing.assert_close(out[-micro:], ref_out.detach(), **TOL)
    training.copyWeightsToHost()
    return training, model, ref


def assert_same_state(model: nn.Module, ref: nn.Module) -> None:
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def program_code(training) -> str:
    """The generated code of every graph the session compiled."""
    session = training._require_compiled().session
    parts = [session.code]
    for graph in session.ir.graphs:
        compiled = session.compiled_graph(graph)
        if compiled is not None:
            parts.append(compiled.module.code)
    return "\n".join(parts)


# -- batch norm: torch's fused kernels ---------------------------------------------------------
def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=0.3), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def test_batch_norm_trains_with_the_fused_kernels_as_eager():
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 4, (8,))
    training, model, ref = train_both(bn_net(), x, y)
    assert_same_state(model, ref)  # weights, running statistics, num_batches_tracked
    code = program_code(training)
    assert "_native_batch_norm_legit_functional" in code and "native_batch_norm_backward" in code
    assert "var_mean" not in code  # not decomposed into elementwise ops


def test_batch_norm_without_running_statistics_trains_as_eager():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), nn.Flatten(),
                        nn.Linear(64, 3))
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))
    training, model, ref = train_both(net, x, y)
    assert_same_state(model, ref)
    assert "native_batch_norm_backward" in program_code(training)


def test_batch_norm_inference_uses_the_running_statistics_kernel():
    net = bn_net()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    net.eval()
    x = torch.randn(4, 3, 6, 6)
    inference = ipuxl.inferenceModel(copy.deepcopy(net))
    torch.testing.assert_close(inference(x), net(x), **TOL)
    assert "_native_batch_norm_legit_no_training" in program_code(inference)


# -- matmuls of a transposed input: folded as eager folds them ---------------------------------
class Attention(nn.Module):
    """``nn.MultiheadAttention(batch_first=True)`` projects a transposed (non-contiguous) input."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def test_projections_of_a_transposed_input_are_one_matmul_as_in_eager():
    torch.manual_seed(2)
    x, y = torch.randn(4, 5, 16), torch.randint(0, 3, (4,))
    training, model, ref = train_both(Attention(), x, y)
    assert_same_state(model, ref)
    code = program_code(training)
    # the projections fold to mm (attention itself runs torch's fused kernel)
    assert "bmm" not in code and "_scaled_dot_product" in code


def test_a_batched_matmul_by_a_trained_matrix_is_folded():
    class Proj(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 5) * 0.3)

        def forward(self, x):
            return (x.transpose(0, 1) @ self.w).sum(0)  # (3, 4, 6) @ (6, 5), x not viewable as rows

    torch.manual_seed(3)
    x, y = torch.randn(4, 3, 6), torch.randint(0, 5, (4,))
    training, model, ref = train_both(Proj(), x, y, momentum=0.0)
    assert_same_state(model, ref)
    assert "bmm" not in program_code(training)


# -- the backward runs eager's backward kernels --------------------------------------------------
@pytest.mark.parametrize("activation, kernel", [(nn.SiLU, "silu_backward"), (nn.Mish, "mish_backward")])
def test_activation_backward_is_the_fused_kernel_eager_runs(activation, kernel):
    """Autograd formulas pick a composite of small ops when the backward itself is being
    differentiated (grad mode on); eager's backward, and ipuxl's, run the fused kernel."""
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(6, 8), activation(), nn.Linear(8, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    training, model, ref = train_both(net, x, y)
    assert_same_state(model, ref)
    assert kernel in program_code(training)


# -- saved views of inputs are recomputed, not copied ---------------------------------------------
def test_transposed_weights_are_not_copied_for_the_backward():
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    training, model, ref = train_both(nn.Sequential(copy.deepcopy(net), copy.deepcopy(net)[:0]), x, y)
    assert_same_state(model, ref)
    assert "torch.clone(" not in program_code(training)


def test_an_outlined_block_saves_its_weights_not_their_transposes():
    """Blocks called several times are graphs of their own: the activations they return
    for the backward must not include views of their weights (a call copies those)."""
    torch.manual_seed(5)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    net = nn.Sequential(nn.Linear(6, 8), copy.deepcopy(block), copy.deepcopy(block), copy.deepcopy(block),
                        nn.Linear(8, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    training, model, ref = train_both(net, x, y)
    assert_same_state(model, ref)
    code = program_code(training)
    assert "ipuxl_compiled_call" in code  # the blocks are outlined
    assert "torch.clone(" not in code


# -- the device keeps its freed memory -----------------------------------------------------------
_PROBE = """
import ctypes, sys, torch, ipuxl
from ipuxl.device import host_memory
x = ipuxl.Tensor if False else None
ir = ipuxl.Ir()
with ir.main_graph:
    v = ipuxl.variable(torch.ones(3).numpy())
    ipuxl.ops.var_updates.accumulate_(v, v)
with ipuxl.Session(ir, "cpu") as s:
    s.run()
print(host_memory.keep_freed_memory())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("env, expected", [("1", "True"), ("0", "False")])
def test_a_session_keeps_freed_memory_unless_told_not_to(env, expected):
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "IPUXL_KEEP_FREED_MEMORY": env})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == expected
