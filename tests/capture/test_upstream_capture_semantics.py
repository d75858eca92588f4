"""Capture semantics that upstream PopTorch's own tests check: ``poptorch._impl.isDispatchTracing``,
the IPU's device names in a forward, CTC losses, a forward's own exceptions, which loss is
the final one, nn.Transformer with masks given as inputs, ``out=`` composites, empty batches
and PopTorch's messages for shapes that depend on values."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import TraceError
from ipuxl.poptorch_compat import wrapping
from tests.capture._eager import train_like_eager


# -- isDispatchTracing and the IPU's device names ------------------------------------------
def test_is_dispatch_tracing_is_true_only_while_a_forward_is_captured():
    seen = []

    class Model(nn.Module):
        def forward(self, x):
            seen.append(wrapping.isDispatchTracing())
            return x * 2

    assert wrapping.isDispatchTracing() is False
    model = poptorch.inferenceModel(Model())
    torch.testing.assert_close(model(torch.ones(3)), torch.full((3,), 2.0))
    assert seen and all(flag is True for flag in seen)
    assert wrapping.isDispatchTracing() is False
    Model()(torch.ones(3))  # eagerly
    assert seen[-1] is False


@pytest.mark.parametrize("device", ["xla", "ipu", torch.device("xla")])
def test_tensors_made_on_the_ipus_device_name_inside_forward(device):
    """Code written for PopTorch's dispatcher makes tensors on its device (``"xla"``, ``"ipu"``)."""
    class Model(nn.Module):
        def forward(self, x):
            ones = torch.ones((2, 3), dtype=x.dtype, device=device)
            return ones + x, torch.zeros(3).to(device) - x

    x = torch.tensor([1.5, 2.0, 3.0])
    out = poptorch.inferenceModel(Model())(x)
    torch.testing.assert_close(out[0], torch.ones(2, 3) + x)
    torch.testing.assert_close(out[1], -x)


# -- CTC loss ------------------------------------------------------------------------------
T, N, C = 10, 4, 5


class CTCModel(nn.Module):
    def __init__(self, targets, input_lengths, target_lengths, **loss_args):
        super().__init__()
        self.lin = nn.Linear(C, C)
        self.targets, self.input_lengths, self.target_lengths = targets, input_lengths, target_lengths
        self.loss_args = loss_args

    def forward(self, x):
        log_probs = self.lin(x).log_softmax(2)
        loss = F.ctc_loss(log_probs, self.targets, self.input_lengths, self.target_lengths, **self.loss_args)
        return log_probs, loss


def _ctc_batch(width, concatenated, blank):
    torch.manual_seed(1)
    target_lengths = torch.tensor([3, width - 1, 1, 4]).clamp(max=width)
    targets = torch.randint(0, C - 1, (N, width))
    targets[targets >= blank] += 1
    if concatenated:
        targets = torch.cat([targets[i, :int(target_lengths[i])] for i in range(N)])
    return torch.randn(T, N, C), targets, torch.tensor([T, T - 2, T, 4]), target_lengths


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("zero_infinity", [False, True])
@pytest.mark.parametrize("concatenated", [False, True], ids=["padded", "concatenated"])
@pytest.mark.parametrize("blank", [0, 3])
def test_ctc_loss_trains_like_eager(reduction, zero_infinity, concatenated, blank):
    """Each step's loss and the weights after it equal eager's; with ``zero_infinity`` a sample
    with no valid alignment (9 labels, with repeats, in 4 steps) counts as 0."""
    x, targets, input_lengths, target_lengths = _ctc_batch(10 if zero_infinity else 6, concatenated, blank)
    model = CTCModel(targets, input_lengths, target_lengths, blank=blank, reduction=reduction,
                     zero_infinity=zero_infinity)
    train_like_eager(model, (x,), steps=2, lr=0.1)


def test_ctc_loss_module_without_reduction_in_inference():
    x, targets, input_lengths, target_lengths = _ctc_batch(6, False, 0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.loss = nn.CTCLoss(reduction="none")

        def forward(self, x, targets, input_lengths, target_lengths):
            return self.loss(x.log_softmax(2), targets, input_lengths, target_lengths)

    args = (x, targets, input_lengths, target_lengths)
    torch.testing.assert_close(poptorch.inferenceModel(Model())(*args), Model()(*args))


# -- a forward's own exceptions --------------------------------------------------------------
class Raises(nn.Module):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def forward(self, x):
        raise self.error


@pytest.mark.parametrize("error", [ValueError("Hi"), KeyError("missing"), AssertionError("shapes differ")])
def test_an_exception_the_forward_raises_reaches_the_caller_unchanged(error):
    """Upstream: ``pytest.raises(ValueError, match="^Hi$")`` (pytest matches the notes too); the
    user's line is the exception's ``where``, as on ipuxl's errors."""
    with pytest.raises(type(error), match=f"^{re.escape(str(error))}$") as info:
        poptorch.inferenceModel(Raises(error))(torch.ones(2))
    assert type(info.value) is type(error) and not getattr(info.value, "__notes__", None)
    assert "test_upstream_capture_semantics.py" in info.value.where and "forward" in info.value.where

    class Model(nn.Module):  # a failure inside torch still names the module
        def forward(self, x):
            return x @ torch.ones(5, 2)

    with pytest.raises(TraceError, match="cannot capture module Model") as failure:
        poptorch.inferenceModel(Model())(torch.ones(3, 4))
    assert isinstance(failure.value, RuntimeError)




# -- which loss is the final one -----------------------------------------------------------------
def test_an_identity_loss_used_by_another_is_not_the_loss():
    """Upstream custom_loss_test::test_non_final_loss_reductions: the outer identity_loss is the loss."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(10, 10)

        def forward(self, x, t):
            out = self.lin(x)
            partial = poptorch.identity_loss(out - t, reduction="mean")
            return out, (partial, poptorch.identity_loss(partial * partial * 5, reduction="mean"))

    torch.manual_seed(0)
    train_like_eager(Model(), (torch.randn(10), torch.randn(10)), loss_of=lambda out: out[1][1])


def _model(forward):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(10, 10)

        def forward(self, x, t):
            return forward(F.log_softmax(self.lin(x), 1), t)

    return Model()


def test_two_independent_losses_are_refused_as_upstream_and_train_once_wrapped():
    model = _model(lambda o, t: (o, F.nll_loss(o, t) + F.nll_loss(o, t) * 5.0))
    with pytest.raises(poptorch.Error, match="Multiple independent losses found in graph. Graph must have one "
                                             "final loss. Wrap final graph loss in poptorch.identity_loss."):
        poptorch.trainingModel(model)(torch.randn(1, 10), torch.randint(0, 10, [1]))
    model = _model(lambda o, t: (o, poptorch.identity_loss(F.nll_loss(o, t) + F.nll_loss(o, t) * 5.0, "none")))
    torch.manual_seed(0)
    train_like_eager(model, (torch.randn(2, 10), torch.randint(0, 10, [2])))


def test_no_loss_is_upstreams_message():
    model = _model(lambda o, t: (o, o * 12))
    with pytest.raises(poptorch.Error, match="Couldn't find a loss in graph"):
        poptorch.trainingModel(model)(torch.randn(1, 10), torch.randint(0, 10, [1]))


# -- nn.Transformer with masks given as inputs ---------------------------------------------
def test_transformer_with_masks_from_the_inputs_is_eagers():
    torch.manual_seed(0)
    model = nn.Transformer(4, 2, 2, 2, 3, dropout=0.0).eval()
    src, tgt, mask = torch.rand(2, 3, 4), torch.rand(2, 3, 4), torch.rand(2, 2)
    torch.testing.assert_close(poptorch.inferenceModel(model)(src, tgt, mask, mask), model(src, tgt, mask, mask))
    causal = nn.Transformer.generate_square_subsequent_mask(2)
    torch.testing.assert_close(poptorch.inferenceModel(model)(src, tgt, causal, causal),
                               model(src, tgt, causal, causal))


# -- out=, empty batches ----------------------------------------------------------------------
def test_matmul_out_writes_out_and_returns_it():
    class Model(nn.Module):
        def forward(self, x, y, out):
            return torch.matmul(x, y, out=out)

    x, y, out = torch.randn(10, 20), torch.randn(20, 5), torch.randn(10, 5)
    result = poptorch.inferenceModel(Model())(x, y, out)
    torch.testing.assert_close(result, x @ y)
    torch.testing.assert_close(out, x @ y)


def test_interpolate_on_an_empty_batch_is_eagers():
    class Model(nn.Module):
        def forward(self, x):
            return F.interpolate(x, size=(10, 10)) + 1

    out = poptorch.inferenceModel(Model())(torch.randn(0, 2, 5, 5))
    assert out.shape == (0, 2, 10, 10)


# -- PopTorch's messages for shapes that depend on values ------------------------------------
def test_one_hot_without_num_classes_is_upstreams_message():
    class Model(nn.Module):
        def forward(self, x):
            return F.one_hot(x, num_classes=-1)

    with pytest.raises(poptorch.Error, match="OneHot num classes must be specified and must be constant."):
        poptorch.inferenceModel(Model())(torch.randint(10, (10,)))


def test_boolean_mask_indexing_is_upstreams_message():
    class Model(nn.Module):
        def forward(self, x):
            return x[x > 0]

    with pytest.raises(poptorch.Error, match="Indexing using boolean or byte tensor masks is unsupported because "
                                             "it would produce dynamic output shapes based on the mask values"):
        poptorch.inferenceModel(Model())(torch.randn(4))


def test_slice_with_tensor_bounds_is_upstreams_message():
    class Model(nn.Module):
        def forward(self, t, e):
            return t[e:e * 2]

    with pytest.raises(poptorch.Error, match=r"The size of the sliced tensor must be a constant for each execution "
                                             r"of the model when running on the IPU\.") as info:
        poptorch.inferenceModel(Model())(torch.arange(8.0), torch.tensor([2]))
    assert "dynamic_slice" in info.value.fix
