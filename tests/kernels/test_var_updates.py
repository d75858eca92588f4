"""``kernels.var_updates.sgd_momentum_step_`` (the fused SGD momentum step the device's
``fuse_sgd_momentum_steps`` puts in place): bit for bit the unfused steps, on both sides of
the fused kernel's size threshold and for every dtype."""
from __future__ import annotations

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
