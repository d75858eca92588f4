"""Checks on tensor values in a captured program (``torch._check``, ``torch._check_tensor_all``,
``torch._assert_async``, ``assert``) run on every call: data that passes trains as eagerly;
data that fails stops the step with a ``DeviceError`` naming the check, and leaves the weights
as eager leaves them (the step before the failing one applied). A branch on data is still
refused, and so is a check torch cannot state as tensor ops."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.sym_node import SymNode

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import DeviceError, TraceError
from tests.capture._checked import LIMIT, Checked
from tests.capture._eager import train_like_eager

CHECKS = ["check", "helper", "check_int", "check_tensor_all", "assert_async", "assert_item", "assert_tensor", "assert_and",
          "assert_not"]


def _batch(scale: float = 1.0):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=gen) * scale, torch.tensor([0, 2, 1, 1, 0, 2])


@pytest.mark.parametrize("how", CHECKS)
def test_data_that_passes_the_check_trains_as_eagerly(how):
    torch.manual_seed(0)
    train_like_eager(Checked(how), _batch(), steps=3, lr=0.1)


@pytest.mark.parametrize("how", CHECKS)
def test_data_that_fails_the_check_stops_the_step_and_keeps_the_weights(how):
    torch.manual_seed(0)
    model = Checked(how)
    eager = copy.deepcopy(model)
    x, y = _batch()
    bad = x.clone()
    bad[3, 1] = 2 * LIMIT
    with pytest.raises((AssertionError, RuntimeError)):  # eager refuses the data too
        eager(bad, y)
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ipu(x, y)  # one good step first: compiled, and its update kept
    with pytest.raises(DeviceError) as caught:
        ipu(bad, y)
    message = str(caught.value)
    assert isinstance(caught.value, RuntimeError)  # as torch.compile's failed checks
    assert "_assert_async" in message and "_checked.py:" in message
    assert "no step of this run completed" in message and "the model's check does not hold" in message
    if how.startswith("assert") and how != "assert_tensor":
        assert "input out of range" in message
    if how in ("check", "assert_item"):
        assert "x.abs().max().item()" in message  # the check's own line, quoted
    if how == "helper":  # the helper's line, and the forward's line that called it
        assert "`torch._check(cond)`" in message and "called from `library_check(x.abs()" in message
    # the weights are those after the good step, as eagerly (where the bad step raised in forward)
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    eager(x, y)[1].backward()
    optimizer.step()
    ipu.copyWeightsToHost()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m, n=name: f"{n}: {m}")
    ipu(x, y)  # good data runs again


def test_a_failing_check_in_the_second_device_iteration_keeps_the_first_update():
    torch.manual_seed(0)
    model = Checked("assert_item")
    eager = copy.deepcopy(model)
    x, y = _batch()
    bad = x.clone()
    bad[4] = -2 * LIMIT  # the second micro-batch (rows 3-5)
    opts = poptorch.Options().deviceIterations(2)
    ipu = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(DeviceError, match="step 2 of 2"):
        ipu(bad, y)
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    eager(x[:3], y[:3])[1].backward()
    optimizer.step()
    with pytest.raises(AssertionError, match="input out of range"):
        eager(bad[3:], y[3:])
    ipu.copyWeightsToHost()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


def test_an_inference_model_keeps_its_checks():
    torch.manual_seed(0)
    model = Checked("assert_async").eval()
    x, y = _batch()
    ipu = poptorch.inferenceModel(model)
    torch.testing.assert_close(ipu(x, y)[0], model(x, y)[0])
    with pytest.raises(DeviceError, match="input out of range"):
        ipu(x * 100, y)


def test_a_branch_on_data_is_still_refused():
    model = Checked("if")
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TraceError, match="data-dependent") as caught:
        ipu(*_batch())
    assert "_checked.py:" in str(caught.value)


def test_a_check_torch_cannot_state_as_tensor_ops_is_refused():
    model = Checked("sqrt")
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TraceError, match="cannot check .* at run time") as caught:
        ipu(*_batch())
    assert "torch._assert_async" in str(caught.value) and "_checked.py:" in str(caught.value)


def test_guards_outside_a_capture_are_torchs_own():
    original = SymNode.guard_bool
    model = Checked("assert_item")
    poptorch.inferenceModel(model)(*_batch())
    assert SymNode.guard_bool is original
    with pytest.raises(AssertionError, match="input out of range"):
        model(*_batch(scale=1000.0))


def test_hugging_faces_xlm_states_its_lengths_with_assert_and_trains_as_eagerly():
    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    config = transformers.XLMConfig(vocab_size=99, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=64,
                                    dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.XLMWithLMHeadModel(config).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 12), generator=gen)
    ids[0, 8:] = config.pad_index
    batch = dict(input_ids=ids, labels=torch.randint(3, 99, (2, 12), generator=gen))
    train_like_eager(model, batch, steps=3, lr=0.05, loss_of=lambda out: out.loss)
