"""What a call of a PopTorch model gives back: None for a forward without outputs, and
upstream's errors for a misuse."""
from __future__ import annotations

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import OptionsError, PoptorchError


class _AddInPlace(torch.nn.Module):
    def forward(self, x, y):
        x += y  # returns nothing: the update of x is the result


@pytest.mark.parametrize("iterations", [1, 3])
def test_a_forward_without_outputs_returns_none_and_updates_its_input(iterations):
    model = poptorch.inferenceModel(_AddInPlace(), poptorch.Options().deviceIterations(iterations))
    x, y = torch.ones(iterations, 2), torch.arange(2.0 * iterations).reshape(iterations, 2)
    assert model(x, y) is None
    torch.testing.assert_close(x, 1 + torch.arange(2.0 * iterations).reshape(iterations, 2))


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
