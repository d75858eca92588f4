"""The device's fused update kernels (``kernels.var_updates``): ``sgd_momentum_step_`` (put in
place by ``fuse_sgd_momentum_steps``) is bit for bit the unfused steps, on both sides of the
fused kernel's size threshold and for every dtype; ``fused_adam_steps_`` (put in place by
``fuse_adam_steps``) steps several weights as ``torch.optim.AdamW`` does, whatever their layout."""
from __future__ import annotations

import pytest
import torch

from ipuxl.kernels import var_updates
from ipuxl.kernels.var_updates import sgd_momentum_step_


def test_sgd_momentum_step_kernel_matches_the_unfused_steps():
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


@pytest.mark.parametrize("scalars", ["host", "device"])
def test_fused_adam_steps_kernel_matches_torch_adamw_on_any_layout(monkeypatch, scalars):
    """Several weights in one call, as torch.optim.AdamW steps them: contiguous, a weight
    with padded rows (a strided view) and a transposed gradient; the decay given as the
    factor ``1 - lr * wd`` (optim.rules) or as popxl.addons' ``weight_decay``. ``device``:
    the factors as a CUDA session has them, never read on the host (forced here on CPU
    tensors: the same arithmetic)."""
    if scalars == "device":
        monkeypatch.setattr(var_updates, "reads_on_host", lambda *factors: False)
        monkeypatch.setattr(torch.Tensor, "__float__", _no_host_reads)
    gen = torch.Generator().manual_seed(0)
    padded = torch.zeros(6, 10)[:, :8]
    shapes = [(5, 7), (6, 8), (130,)]
    for form in ("factor", "weight_decay"):
        weights = [torch.randn(s, generator=gen) for s in shapes]
        weights[1] = padded.copy_(torch.randn(6, 8, generator=gen))
        grads = [torch.randn(s, generator=gen) for s in shapes]
        grads[0] = torch.randn(7, 5, generator=gen).t()  # not contiguous
        params = [torch.nn.Parameter(w.detach().clone()) for w in weights]
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-6, foreach=False)
        ms, vs = [torch.zeros_like(w) for w in weights], [torch.zeros_like(w) for w in weights]
        steps = [torch.tensor(0.0) for _ in weights]
        lr = torch.tensor(0.01)
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
            decay, wd = (1 - lr * 0.1, None) if form == "factor" else (None, 0.1)
            var_updates.fused_adam_steps_(weights, grads, ms, vs, steps, -lr, decay, wd, 0.9, 0.999, 1e-6)
        assert weights[1].data_ptr() == padded.data_ptr()  # updated where it lives
        for w, p in zip(weights, params):
            torch.testing.assert_close(w, p.detach(), rtol=1e-6, atol=1e-7)
        assert [s.item() for s in steps] == [3.0] * 3


def _no_host_reads(t):
    raise AssertionError("a factor was read on the host")


def test_which_factors_are_read_on_the_host():
    assert var_updates.reads_on_host(0.1, None, torch.tensor(0.5))
    assert not var_updates.reads_on_host(0.1, torch.tensor(0.5, device="meta"))
