"""PopTorch's identity-like ops and hints (``nop``, ``recomputationCheckpoint``, ``serializedMatMul``,
``MultiConv``...: ``ipuxl.poptorch_compat.ops.hints``) in trained models, and their argument checks."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import OpArgumentError
from tests.poptorch_compat._checks import raises_in
from tests.poptorch_compat.ops._harness import Wrap, assert_same_weights, train_both

raises = raises_in(__file__)


# -- identity-like ops and hints ----------------------------------------------------------------------
def test_hints_are_identities_in_a_trained_model():
    def forward(m, x, y):
        # NoOverlap: overlapping needs ShardedExecution and IO tiles, as upstream
        # (test_upstream_options_semantics.py covers that)
        x = poptorch.set_overlap_for_input(x, poptorch.OverlapMode.NoOverlap)
        h = poptorch.serializedMatMul(x, m.w, poptorch.MatMulSerializationMode.OutputChannels, 2)
        h = poptorch.set_available_memory(poptorch.nop(h), 0.3)
        h, g = poptorch.recomputationCheckpoint(torch.tanh(h), h * 2)
        out = poptorch.set_overlap_for_output({"out": h + g}, poptorch.OverlapMode.NoOverlap)["out"]
        return out, F.mse_loss(out, y)

    torch.manual_seed(0)
    model = Wrap(forward)
    model.w = nn.Parameter(torch.randn(3, 4))
    device, eager = train_both(model, (torch.randn(5, 3), torch.randn(5, 4)))
    assert_same_weights(device, eager)


def test_recomputation_checkpoint_returns_what_it_was_given():
    a, b = torch.ones(1), torch.zeros(1)
    assert poptorch.recomputationCheckpoint(a) is a
    assert poptorch.recomputationCheckpoint(a, b) == (a, b)
    assert isinstance(poptorch.recomputationCheckpoint([a, b]), list)
    with pytest.raises(ValueError, match="All inputs must be tensors"):
        poptorch.recomputationCheckpoint(a, 3)


@pytest.mark.parametrize("call, fragment", [
    (lambda x: poptorch.serializedMatMul(x, x.T, "output_channels", 2), "must be a poptorch.MatMulSerializationMode"),
    (lambda x: poptorch.serializedMatMul(x, x.T, poptorch.MatMulSerializationMode.ReducingDim, 3),
     "factor 3 must be >= 1 and divide the reducing dimension (lhs dim -1) of length 4"),
    (lambda x: poptorch.serializedMatMul(x, x.T, poptorch.MatMulSerializationMode.InputChannels, 0),
     "factor 0"),
    (lambda x: poptorch.serializedMatMul(x, x.T, poptorch.MatMulSerializationMode.Disabled, 2, keep_precision=1),
     "keep_precision must be a bool"),
    (lambda x: poptorch.set_available_memory(x, 1.5), "must be a number in [0, 1], got 1.5"),
    (lambda x: poptorch.set_available_memory(3.0, 0.5), "You may only set available memory for torch.tensor"),
    (lambda x: poptorch.set_overlap_for_input([x, 2], poptorch.OverlapMode.NoOverlap), "You may only set overlap"),
    (lambda x: poptorch.set_overlap_for_output(x, "no_overlap"), "mode must be a poptorch.OverlapMode"),
    (lambda x: poptorch.nop(3), "nop must take a torch.tensor argument."),
])
def test_hints_check_their_arguments_as_poptorch(call, fragment):
    with raises(OpArgumentError, fragment):
        call(torch.ones(2, 4))


def test_multi_conv_trains_like_eager_and_checks_its_setters():
    def forward(m, x, y):
        multi = (poptorch.MultiConv().availableMemoryProportions([0.3, 0.4]).partialsTypes(torch.half)
                 .planType(poptorch.MultiConvPlanType.Serial).perConvReservedTiles(10).cycleBackOff(0.2)
                 .enableConvDithering(True))
        with multi:
            a, b = m.a(x), m.b(x)
        out = (a + b).mean((2, 3))
        return out, F.mse_loss(out, y)

    torch.manual_seed(0)
    model = Wrap(forward, a=nn.Conv2d(2, 3, 3, padding=1), b=nn.Conv2d(2, 3, 1))
    device, eager = train_both(model, (torch.randn(2, 2, 5, 5), torch.randn(2, 3)))
    assert_same_weights(device, eager)
    with raises(OpArgumentError, "Invalid available memory proportion!") as info:
        poptorch.MultiConv().availableMemoryProportions([0.1, 1])
    assert isinstance(info.value, AssertionError)
    with raises(OpArgumentError, "Invalid partials types") as info:
        poptorch.MultiConv().partialsTypes([torch.float, torch.int32])
    assert isinstance(info.value, ValueError)
    with raises(OpArgumentError, "Invalid plan type!"):
        poptorch.MultiConv().planType(0)
    with raises(OpArgumentError, "value must be bool or list of bools"):
        poptorch.MultiConv().enableConvDithering("yes")
