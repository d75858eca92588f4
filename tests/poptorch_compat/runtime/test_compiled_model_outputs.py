"""What a call of a PopTorch model gives back: None for a forward without outputs,
outputs whose ``backward()`` is refused, and upstream's errors for a misuse."""
from __future__ import annotations

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import ExecutorError, OptionsError, PoptorchError


class _AddInPlace(torch.nn.Module):
    def forward(self, x, y):
        x += y  # returns nothing: the update of x is the result


@pytest.mark.parametrize("iterations", [1, 3])
def test_a_forward_without_outputs_returns_none_and_updates_its_input(iterations):
    model = poptorch.inferenceModel(_AddInPlace(), poptorch.Options().deviceIterations(iterations))
    x, y = torch.ones(iterations, 2), torch.arange(2.0 * iterations).reshape(iterations, 2)
    assert model(x, y) is None
    torch.testing.assert_close(x, 1 + torch.arange(2.0 * iterations).reshape(iterations, 2))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        out = self.lin(x)
        return out, poptorch.identity_loss(out.sum(), reduction="sum")


@pytest.mark.parametrize("training", [True, False])
def test_backward_on_an_output_is_refused_with_upstreams_error(training):
    wrap = poptorch.trainingModel if training else poptorch.inferenceModel
    out, loss = wrap(_Net())(torch.ones(1, 2))
    for tensor in (out, loss):
        with pytest.raises(ExecutorError, match=r"backward\(\) cannot be called explicitly on outputs of a PopTorch "
                                                r"model") as info:
            tensor.backward()
        assert isinstance(info.value, (PoptorchError, RuntimeError))
    assert out.detach().sum().item() == pytest.approx(out.sum().item())  # the values are untouched


def test_inference_with_gradient_accumulation_is_a_poptorch_error():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(PoptorchError, match=r"You must set poptorch\.Options\(\)\.Training\.gradientAccumulation "
                                            r"to 1 or leave it as its default value \(1\)") as info:
        poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)(torch.ones(2, 2))
    assert isinstance(info.value, OptionsError)


def test_running_an_offline_model_asserts_with_upstreams_words():
    model = poptorch.inferenceModel(torch.nn.Linear(2, 2), poptorch.Options().useOfflineIpuTarget())
    with pytest.raises(AssertionError, match=r"Trying to run a model on an offline device \(ConnectionType\.Never\)"):
        model(torch.ones(1, 2))
