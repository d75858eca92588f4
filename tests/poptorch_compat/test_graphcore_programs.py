"""What Graphcore's PyTorch programs (graphcore/examples tutorials, feature examples,
applications) use beyond the basics, checked against eager PyTorch or PopART's rules:

- ``poptorch.optim.AdamW(..., loss_scaling=None)`` (the mixed-precision tutorial, float32 run);
- PopART's float16 optimiser numerics (the same tutorial with ``model.half()`` and
  ``accum_type=torch.float16``, ``loss_scaling=1024``);
- ``import popart`` for the enums programs pass to ``Options._Popart.set``;
- ``poptorch.Attribute`` and ``poptorch._impl`` (optimum-graphcore);
- an octave convolution (two resolutions, pooled and interpolated, then flattened),
  channels-last (the octave-convolution feature example).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl.compat as compat
import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import CompatImportError
from ipuxl.poptorch_compat.ops import register_custom_op


@pytest.fixture
def graphcore_names():
    compat.install()
    yield
    compat.uninstall()


class Classifier(nn.Module):
    def __init__(self, d_in: int = 16, classes: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(d_in, 32)
        self.fc2 = nn.Linear(32, classes)

    def forward(self, x, y):
        out = F.log_softmax(self.fc2(torch.relu(self.fc1(x))), dim=1)
        return out, F.nll_loss(out, y)


def _data(rows: int, scale: float = 1.0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 16, generator=g)
    return (x * scale).to(dtype), (x @ torch.randn(16, 4, generator=g)).argmax(1)


def test_adamw_loss_scaling_none_is_poptorchs_default():
    model = Classifier()
    reference = Classifier()
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=0.01, accum_type=torch.float32, loss_scaling=None)
    assert optimizer.loss_scaling == 1.0 and optimizer.accum_type == torch.float32
    none_types = poptorch.optim.Adam(model.parameters(), first_order_momentum_accum_type=None)
    assert none_types.first_order_momentum_accum_type == torch.float32  # PopTorch: None is float32
    training = poptorch.trainingModel(model, poptorch.Options(), optimizer=optimizer)
    eager = torch.optim.AdamW(reference.parameters(), lr=0.01)
    x, y = _data(32)
    for s in range(0, 32, 8):
        training(x[s:s + 8], y[s:s + 8])
        eager.zero_grad()
        reference(x[s:s + 8], y[s:s + 8])[1].backward()
        eager.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _popart_adamw_steps(model: nn.Module, x, y, steps: int, lr: float, ls: float, wd: float = 0.01) -> None:
    """PopART's AdamW on float16 weights with float32 moments: the float16 gradient of the
    scaled loss is cast to float32, unscaled, fed to the float32 moments; the update term
    is float32 and the weight is updated and rounded to float16."""
    params = list(model.parameters())
    m = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    v = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for t in range(1, steps + 1):
        xs, ys = x[(t - 1) * 8:t * 8], y[(t - 1) * 8:t * 8]
        model.zero_grad()
        (model(xs, ys)[1] * ls).backward()
        with torch.no_grad():
            for p, mi, vi in zip(params, m, v):
                g = p.grad.float() / ls
                mi.mul_(0.9).add_(g, alpha=0.1)
                vi.mul_(0.999).addcmul_(g, g, value=0.001)
                update = (mi / (1 - 0.9 ** t)) / ((vi / (1 - 0.999 ** t)).sqrt() + 1e-8)
                w = p.float() * (1 - lr * wd) - lr * update
                p.copy_(w.half())


def test_float16_adamw_uses_popart_numerics():
    """The mixed-precision tutorial's settings: gradients so small their squares vanish in
    float16 (eager torch's float16 AdamW divides by eps there and blows up); PopART keeps
    the moments in float32, and so does ipuxl."""
    x, y = _data(40, scale=1e-3, dtype=torch.float16)
    model = Classifier().half()
    reference = Classifier().half()
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=1e-3, accum_type=torch.float16, loss_scaling=1024)
    options = poptorch.Options()
    options.Precision.enableStochasticRounding(True)
    training = poptorch.trainingModel(model, options, optimizer=optimizer)
    for s in range(0, 40, 8):
        training(x[s:s + 8], y[s:s + 8])
    _popart_adamw_steps(reference, x, y, 5, lr=1e-3, ls=1024)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        # float16 weights: the update rounds to float16 on both sides, in a different order
        assert_close(p.detach().float(), q.detach().float(), rtol=2e-3, atol=2e-4, msg=name)
    eager = Classifier().half()
    torch_adamw = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for s in range(0, 40, 8):
        torch_adamw.zero_grad()
        eager(x[s:s + 8], y[s:s + 8])[1].backward()
        torch_adamw.step()
    drift = max((p.float() - q.float()).abs().max().item() for p, q in zip(eager.parameters(), reference.parameters()))
    assert not drift < 1e-2  # eager float16 AdamW is far off (or NaN): the numerics differ


def test_the_popart_enums_programs_pass_to_options(graphcore_names):
    import popart
    import poptorch as pt

    opts = pt.Options()
    opts._Popart.set("accumulateOuterFragmentSettings.schedule",
                     int(popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized))
    opts._Popart.set("subgraphCopyingStrategy", int(popart.SubgraphCopyingStrategy.JustInTime))
    assert opts._Popart.options["accumulateOuterFragmentSettings.schedule"] == 3
    assert opts._Popart.options["subgraphCopyingStrategy"] == 1
    assert int(getattr(popart.RecomputationType, "None")) == 0 and int(popart.VirtualGraphMode.Manual) == 1
    assert popart.ReductionType.Mean.name == "Mean" and int(popart.TensorStorage.OffChip) == 1
    with pytest.raises(CompatImportError, match="'popart.Builder' is part of PopART but ipuxl does not provide it"):
        popart.Builder()
    with pytest.raises(ImportError, match="TrainingSession"):
        from popart import TrainingSession  # noqa: F401
    assert not hasattr(popart, "_private_name")


def test_attribute_scopes_and_model_unwrapping(graphcore_names):
    import poptorch as pt
    from poptorch._impl import rewrapModelIfNecessary, unwrapModelIfNecessary

    class Outlined(Classifier):
        def forward(self, x, y):
            with pt.Attribute(__outline={"layer": 0}):
                with pt.Attribute(__outline={"layer": 1}, __recompute={"mode": "on"}):
                    assert pt.Attribute.current() == {"__outline": {"layer": 1}, "__recompute": {"mode": "on"}}
                h = torch.relu(self.fc1(x))
                assert pt.Attribute.current() == {"__outline": {"layer": 0}}
            return super().forward(x, y)

    model = Outlined()
    reference = Outlined()
    training = pt.trainingModel(model, pt.Options(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(8)
    out, loss = training(x, y)
    assert pt.Attribute.current() == {}
    with torch.no_grad():
        assert_close(out, reference(x, y)[0], rtol=1e-5, atol=1e-6)
    unwrapModelIfNecessary(model)  # the host module can run eagerly (optimum generates text this way)
    torch.optim.SGD(reference.parameters(), lr=0.1).zero_grad()
    reference(x, y)[1].backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
        assert_close(model(x, y)[0], reference(x, y)[0], rtol=1e-5, atol=1e-6)
    rewrapModelIfNecessary(model)
    training(x, y)  # and the device model keeps training


class OctaveBlock(nn.Module):
    """An octave convolution (high and low resolution features, exchanged by average
    pooling and nearest interpolation), batch norm, ReLU and max pooling on both."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.h2h, self.h2l = nn.Conv2d(c_in, c_out, 3, padding=1), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.l2h, self.l2l = nn.Conv2d(c_out, c_out, 3, padding=1), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.norm_h, self.norm_l = nn.BatchNorm2d(c_out), nn.BatchNorm2d(c_out)

    def forward(self, x):
        high = self.h2h(x)
        low = self.h2l(F.avg_pool2d(x, 2))
        high = high + F.interpolate(self.l2h(low), size=high.shape[-2:])
        low = low + self.l2l(low)
        return F.max_pool2d(torch.relu(self.norm_h(high)), 2), F.max_pool2d(torch.relu(self.norm_l(low)), 2)


class OctaveNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = OctaveBlock(3, 4)
        self.fc = nn.Linear(4 * 4 * 4 + 4 * 2 * 2, 10)

    def forward(self, x, labels):
        high, low = self.block(x)
        out = torch.cat([torch.flatten(high, start_dim=1), torch.flatten(low, start_dim=1)], 1)
        out = F.log_softmax(self.fc(out), dim=1)
        return out, F.nll_loss(out, labels)


@pytest.mark.parametrize("channels_last", ["0", "1"])
def test_octave_convolution_trains_as_eager_in_either_memory_format(monkeypatch, channels_last):
    monkeypatch.setenv("IPUXL_CHANNELS_LAST", channels_last)
    model, reference = OctaveNet(), OctaveNet()
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(2),
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
    training(x[:8], y[:8])
    training(x[8:], y[8:])
    eager = torch.optim.SGD(reference.parameters(), lr=0.05)
    for s in range(0, 16, 4):
        eager.zero_grad()
        reference(x[s:s + 4], y[s:s + 4])[1].backward()
        eager.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_debertas_fast_gather_custom_op_runs_as_the_gather_it_optimises():
    """optimum-graphcore's DeBERTa calls a C++ PopART op, FastGatherLastDim, on the device
    (``poptorch.isRunningOnIpu()``) and ``torch.gather`` eagerly: registering the gather as
    its implementation runs the model unchanged."""
    register_custom_op("FastGatherLastDim", "poptorch.custom_ops", 1,
                       lambda data, idx, axis: torch.gather(data, axis, idx))

    class Gathering(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(6, 5)

        def forward(self, x, idx):
            data = self.fc(x)
            if poptorch.isRunningOnIpu():  # as optimum's FastGatherLastDim module
                target = torch.zeros_like(idx).to(data.dtype).requires_grad_()
                out = poptorch.custom_op([data, idx], "FastGatherLastDim", "poptorch.custom_ops", 1,
                                         example_outputs=[target], attributes={"axis": -1})[0]
            else:
                out = torch.gather(data, -1, idx)
            return out, poptorch.identity_loss((out ** 2).mean(), "none")

    model, reference = Gathering(), Gathering()
    training = poptorch.trainingModel(model, poptorch.Options(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(3)
    x, idx = torch.randn(4, 6, generator=g), torch.randint(0, 5, (4, 3), generator=g)
    out, _ = training(x, idx)
    eager_out, loss = reference(x, idx)
    assert_close(out, eager_out.detach(), rtol=1e-5, atol=1e-6)
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
