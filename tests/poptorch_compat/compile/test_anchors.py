"""Options.anchorTensor / PoplarExecutor.getAnchoredTensor against eager PyTorch.

Eager is the oracle: the same model, optimiser and batches run step by step in torch;
``Gradient___`` is a micro-batch's ``p.grad`` on one replica, ``Accum___`` the
gradient the optimiser step receives, ``UpdatedVar___`` the weight after the step and
``<param>`` the weight before it (PopTorch 3's names: ``named_parameters()`` paths).
Host data layout: iterations outermost, then gradient accumulation, then replicas,
then the micro-batch (PopART's).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import ipuxl
from ipuxl import Options, OutputMode
from ipuxl.errors import AnchorError
from ipuxl.poptorch_compat.enums import ReductionType

TOL = dict(rtol=1e-5, atol=1e-6)
MICRO = 4
NAMES = {"grad": "Gradient___fc2.bias", "accum": "Accum___fc2.bias",
         "updated": "UpdatedVar___fc2.weight", "weight": "fc2.weight"}


class Model(nn.Module):
    """Upstream's anchoring example: two Linear layers and an MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(5, 3)
        self.loss = nn.MSELoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = self.fc2(self.relu(self.fc1(x)))
        return self.loss(out, labels) if self.training else out


def _data(samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 6, generator=gen), torch.randn(samples, 3, generator=gen)


def _anchor_all(opts: Options, mode: OutputMode | None = None, period: int = 1) -> Options:
    for short, long_name in NAMES.items():
        opts.anchorTensor(short, long_name, mode, period)
    return opts


def _eager_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, g: int, r: int,
                 lr: float = 0.1) -> dict[str, list[torch.Tensor]]:
    """Eager SGD steps; per step: each micro-batch's fc2.bias gradient (``[mb][replica]``
    flattened), the combined gradient, the weight before and after."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    seen: dict[str, list[torch.Tensor]] = {"grad": [], "accum": [], "weight": [], "updated": []}
    for xs, ys in zip(x.chunk(steps), y.chunk(steps)):
        seen["weight"].append(model.fc2.weight.detach().clone())
        for xm, ym in zip(xs.split(MICRO), ys.split(MICRO)):  # g-major, then replica
            model.zero_grad()
            model(xm, ym).backward()
            seen["grad"].append(model.fc2.bias.grad.clone())
        opt.zero_grad()
        model(xs, ys).backward()  # the mean loss over the step's micro-batches
        seen["accum"].append(model.fc2.bias.grad.clone())
        opt.step()
        seen["updated"].append(model.fc2.weight.detach().clone())
    return seen


def _run(opts: Options, calls: int, steps: int, g: int, r: int) -> tuple[list[dict], dict, nn.Module]:
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    got = []
    per_call = steps * g * r * MICRO
    x, y = _data(calls * per_call)
    for c in range(calls):
        training(x[c * per_call:(c + 1) * per_call], y[c * per_call:(c + 1) * per_call])
        got.append({short: training.getAnchoredTensor(short) for short in NAMES})
    seen = _eager_steps(reference, x, y, calls * steps, g, r)
    return got, seen, model


def test_gradient_and_updated_weight_match_eager_over_calls() -> None:
    got, seen, model = _run(_anchor_all(Options()), calls=3, steps=1, g=1, r=1)
    for c in range(3):  # default training mode: Final, the tensor's own shape
        torch.testing.assert_close(got[c]["grad"], seen["grad"][c], **TOL)
        torch.testing.assert_close(got[c]["accum"], seen["accum"][c], **TOL)
        torch.testing.assert_close(got[c]["weight"], seen["weight"][c], **TOL)
        torch.testing.assert_close(got[c]["updated"], seen["updated"][c], **TOL)
    assert got[0]["grad"].shape == (3,) and got[0]["updated"].shape == (3, 5)
    assert not torch.equal(got[0]["updated"], got[1]["updated"])
    torch.testing.assert_close(got[-1]["updated"], model.fc2.weight.detach(), **TOL)


@pytest.mark.parametrize("mode, period", [(OutputMode.All, 1), (OutputMode.EveryN, 2), (OutputMode.Final, 1),
                                          (OutputMode.Sum, 1)])
def test_output_modes_over_device_iterations(mode: OutputMode, period: int) -> None:
    steps = 4
    got, seen, _ = _run(_anchor_all(Options().deviceIterations(steps), mode, period), calls=1, steps=steps,
                        g=1, r=1)
    for short in NAMES:
        per_step = torch.stack(seen[short])
        if mode is OutputMode.All:
            expected = torch.cat(list(per_step))
        elif mode is OutputMode.EveryN:
            expected = torch.cat(list(per_step[period - 1::period]))
        elif mode is OutputMode.Final:
            expected = per_step[-1]
        else:
            expected = per_step.sum(0)
        torch.testing.assert_close(got[0][short], expected, **TOL)


def test_anchor_without_mode_takes_the_models_output_mode() -> None:
    opts = Options().deviceIterations(3).outputMode(OutputMode.All)
    opts.anchorTensor("grad", NAMES["grad"])
    opts.anchorTensor("final", NAMES["grad"], OutputMode.Final)
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(3 * MICRO)
    training(x, y)
    seen = _eager_steps(reference, x, y, 3, 1, 1)
    torch.testing.assert_close(training.getAnchoredTensor("grad"), torch.cat(seen["grad"]), **TOL)
    torch.testing.assert_close(training.getAnchoredTensor("final"), seen["grad"][-1], **TOL)


def test_gradient_accumulation() -> None:
    g, steps = 3, 2
    opts = _anchor_all(Options().deviceIterations(steps), OutputMode.All)
    opts.Training.gradientAccumulation(g)
    got, seen, _ = _run(opts, calls=2, steps=steps, g=g, r=1)
    for c in range(2):
        # one gradient per micro-batch (iterations, then micro-batches); the rest once per step
        torch.testing.assert_close(got[c]["grad"], torch.cat(seen["grad"][c * steps * g:(c + 1) * steps * g]), **TOL)
        for short in ("accum", "weight", "updated"):
            torch.testing.assert_close(got[c][short], torch.cat(seen[short][c * steps:(c + 1) * steps]), **TOL)


def test_gradient_accumulation_sum_reduction_accumulates_the_sum() -> None:
    g = 2
    opts = Options()
    opts.Training.gradientAccumulation(g).accumulationAndReplicationReductionType(ReductionType.Sum)
    opts.anchorTensor("accum", NAMES["accum"])
    opts.anchorTensor("grads", NAMES["grad"], OutputMode.Sum)
    model = Model()
    training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(g * MICRO)
    training(x, y)
    torch.testing.assert_close(training.getAnchoredTensor("accum"), training.getAnchoredTensor("grads"), **TOL)


def test_replication_gives_each_replicas_gradient() -> None:
    r = 2
    got, seen, _ = _run(_anchor_all(Options().replicationFactor(r)), calls=2, steps=1, g=1, r=r)
    for c in range(2):
        # Final: one value per replica, concatenated; the combined gradient and weights as eager's
        torch.testing.assert_close(got[c]["grad"], torch.cat(seen["grad"][c * r:(c + 1) * r]), **TOL)
        torch.testing.assert_close(got[c]["accum"], torch.cat([seen["accum"][c]] * r), **TOL)
        torch.testing.assert_close(got[c]["updated"], torch.cat([seen["updated"][c]] * r), **TOL)


@pytest.mark.parametrize("outline", [False, True])
def test_iterations_accumulation_and_replicas_together(outline: bool) -> None:
    opts = _anchor_all(Options().deviceIterations(2).replicationFactor(2).autoOutline(outline), OutputMode.All)
    opts.Training.gradientAccumulation(2)
    got, seen, _ = _run(opts, calls=1, steps=2, g=2, r=2)
    # All: iterations, then micro-batches, then replicas, concatenated along the first dimension
    torch.testing.assert_close(got[0]["grad"], torch.cat(seen["grad"]), **TOL)
    for short in ("accum", "weight", "updated"):  # once per step, equal on both replicas
        torch.testing.assert_close(got[0][short], torch.cat([t for t in seen[short] for _ in range(2)]), **TOL)


@pytest.mark.parametrize("new_scaling", [None, 32.0])
def test_loss_scaling_is_in_the_gradient_not_in_the_accumulated_one(new_scaling: float | None) -> None:
    """Also after setOptimizer changes it (loss_scaling passed to the constructor is a
    variable attribute, written to the device without recompiling)."""
    opts = Options()
    opts.anchorTensor("grad", NAMES["grad"])
    opts.anchorTensor("accum", NAMES["accum"])
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    optimizer = ipuxl.optim.SGD(model.parameters(), lr=0.1, loss_scaling=8.0)
    training = ipuxl.trainingModel(model, opts, optimizer=optimizer)
    x, y = _data(2 * MICRO)
    training(x[:MICRO], y[:MICRO])
    if new_scaling is not None:
        optimizer.loss_scaling = new_scaling
        training.setOptimizer(optimizer)
    training(x[MICRO:], y[MICRO:])
    seen = _eager_steps(reference, x, y, 2, 1, 1)
    assert training.compile_count == 1
    scaling = new_scaling or 8.0
    torch.testing.assert_close(training.getAnchoredTensor("grad"), scaling * seen["grad"][1], **TOL)
    torch.testing.assert_close(training.getAnchoredTensor("accum"), seen["accum"][1], **TOL)


def test_loss_argument_keeps_upstream_names() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc2 = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(x)

    opts = Options()
    opts.anchorTensor("grad", NAMES["grad"])
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)
    training = ipuxl.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                   loss=nn.MSELoss())
    x, y = _data(MICRO)
    training(x, y)
    nn.MSELoss()(reference(x), y).backward()
    torch.testing.assert_close(training.getAnchoredTensor("grad"), reference.fc2.bias.grad, **TOL)


def test_poptorch2_spelling_with_model_prefix_is_accepted() -> None:
    opts = Options()
    opts.anchorTensor("old", "Gradient___model.fc2.bias")  # PopTorch 2's JIT-traced name
    opts.anchorTensor("new", NAMES["grad"])
    training = ipuxl.trainingModel(Model(), opts)
    training(*_data(MICRO))
    torch.testing.assert_close(training.getAnchoredTensor("old"), training.getAnchoredTensor("new"), rtol=0, atol=0)


def test_inference_anchors_a_weight() -> None:
    opts = Options().deviceIterations(2)
    opts.anchorTensor("w", NAMES["weight"], OutputMode.Final)
    model = Model()
    inference = ipuxl.inferenceModel(model, opts)
    inference(torch.randn(2 * MICRO, 6))
    torch.testing.assert_close(inference.getAnchoredTensor("w"), model.fc2.weight.detach())


def test_tensor_names_list_the_anchorable_names() -> None:
    training = ipuxl.trainingModel(Model(), Options())
    training(*_data(MICRO))
    names = training.getTensorNames()
    assert set(NAMES.values()) <= set(names)
    assert "UpdatedVar___fc1.bias" in names


# -- errors -----------------------------------------------------------------------------
def test_unknown_long_name_fails_at_compile_listing_valid_names() -> None:
    opts = Options()
    opts.anchorTensor("grad", "Gradient___fc2.bais")
    training = ipuxl.trainingModel(Model(), opts)
    with pytest.raises(AnchorError, match=r"'Gradient___fc2.bais'.*did you mean 'Gradient___fc2.bias'\?") as info:
        training(*_data(MICRO))
    assert isinstance(info.value, RuntimeError) and "fix:" in str(info.value)
    assert not training.isCompiled()


def test_gradient_anchor_on_an_inference_model_fails() -> None:
    opts = Options()
    opts.anchorTensor("grad", NAMES["grad"])
    inference = ipuxl.inferenceModel(Model(), opts)
    with pytest.raises(AnchorError, match="inference model has no gradients"):
        inference(torch.randn(MICRO, 6))


def test_gradient_anchor_of_a_frozen_parameter_fails() -> None:
    model = Model()
    model.fc2.bias.requires_grad_(False)
    opts = Options()
    opts.anchorTensor("grad", NAMES["grad"])
    training = ipuxl.trainingModel(model, opts,
                                   optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad]))
    with pytest.raises(AnchorError, match="no tensor of the program has that name"):
        training(*_data(MICRO))


def test_get_anchored_tensor_errors() -> None:
    opts = Options()
    opts.anchorTensor("grad", NAMES["grad"])
    training = ipuxl.trainingModel(Model(), opts)
    with pytest.raises(AssertionError, match="has not run yet"):  # upstream asserts
        training.getAnchoredTensor("grad")
    training(*_data(MICRO))
    with pytest.raises(AnchorError, match=r"no tensor with name 'other' found; anchored: 'grad'"):
        training.getAnchoredTensor("other")
    assert training.getAnchoredTensor("grad").shape == (3,)
