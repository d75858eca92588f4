"""``F.one_hot`` keeps eager's range check on the device: an out-of-range class fails the
run (eager raises too) instead of giving a silent zero row; no class count is refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import DeviceError, TraceError
from tests.poptorch_compat._checks import sgd_steps_like_eager


class OneHot(nn.Module):
    def __init__(self, classes: int | None = 4):
        super().__init__()
        self.classes = classes
        self.fc = nn.Linear(4, 4)

    def forward(self, x, labels):
        target = F.one_hot(labels) if self.classes is None else F.one_hot(labels, self.classes)
        out = self.fc(x)
        return out, ((out - target.float()) ** 2).mean()


def test_in_range_trains_like_eager():
    torch.manual_seed(0)
    model = OneHot()
    inputs = (torch.randn(6, 4), torch.tensor([0, 3, 1, 2, 3, 0]))
    _, ref = sgd_steps_like_eager(model, inputs, steps=3, lr=0.1, tol=dict(rtol=1e-5, atol=1e-6))
    torch.testing.assert_close(model.fc.weight.detach(), ref.fc.weight.detach())


def test_out_of_range_class_fails_the_run_as_eager_does():
    model = OneHot()
    x, bad = torch.randn(2, 4), torch.tensor([0, 5])
    with pytest.raises(RuntimeError, match="Class values must be smaller than num_classes") as eager:
        model(x, bad)
    inference = poptorch.inferenceModel(model)
    inference(x, torch.tensor([0, 3]))  # compiles and runs in range
    with pytest.raises(DeviceError, match="Class values must be smaller than num_classes") as device:
        inference(x, bad)
    assert isinstance(device.value, type(eager.value)) and "one_hot" in str(device.value)


def test_one_hot_without_num_classes_is_refused_at_capture():
    with pytest.raises(TraceError, match="F.one_hot without num_classes") as info:
        poptorch.inferenceModel(OneHot(classes=None))(torch.randn(2, 4), torch.tensor([0, 3]))
    assert "test_checks.py" in info.value.where and "num_classes" in info.value.fix
