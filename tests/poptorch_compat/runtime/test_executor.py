"""trainingModel against eager PyTorch: weights after N device iterations, gradient
accumulation, output modes, optimiser translation, setOptimizer."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import ipuxl
from ipuxl import Options, OutputMode

TOL = dict(rtol=1e-5, atol=1e-6)


class MLP(nn.Module):
    """A small classifier returning ``(logits, loss)`` as PopTorch models do."""

    def __init__(self, d_in: int = 12, hidden: int = 16, classes: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out, self.loss(out, y)


def make_data(batch: int, d_in: int = 12, classes: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g)


def eager_steps(model: nn.Module, optimizer: torch.optim.Optimizer, x, y, micro: int):
    """One optimiser step per micro-batch; returns the per-step outputs and losses."""
    outs, losses = [], []
    for xs, ys in zip(x.split(micro), y.split(micro)):
        optimizer.zero_grad()
        out, loss = model(xs, ys)
        loss.backward()
        optimizer.step()
        outs.append(out.detach())
        losses.append(loss.detach())
    return torch.stack(outs), torch.stack(losses)


def assert_same_weights(a: nn.Module, b: nn.Module, **tol) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m, n=name: f"{n}: {m}", **(tol or TOL))


def two_groups(model: MLP, cls, **kwargs):
    return cls([{"params": model.fc1.parameters(), "lr": 0.05},
                {"params": model.fc2.parameters()}], **kwargs)


OPTIMISERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd_momentum_wd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov_dampening_groups": lambda m: two_groups(m, torch.optim.SGD, lr=0.1, momentum=0.8, nesterov=True),
    "sgd_dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.3),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adam_wd_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.1, amsgrad=True),
    "adamw_groups": lambda m: two_groups(m, torch.optim.AdamW, lr=0.01, weight_decay=0.05),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01),
    "rmsprop_centered_momentum": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5,
                                                               centered=True, weight_decay=0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_device_iterations_equal_eager_steps(name):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opts = Options().deviceIterations(4)
    training = ipuxl.trainingModel(model, opts, optimizer=OPTIMISERS[name](model))
    ref_opt = OPTIMISERS[name](ref)
    for call in range(3):
        x, y = make_data(4 * 6, seed=call)
        out, loss = training(x, y)
        ref_out, ref_loss = eager_steps(ref, ref_opt, x, y, 6)
        torch.testing.assert_close(out, ref_out[-1], **TOL)  # default output mode: Final
        torch.testing.assert_close(loss, ref_loss[-1], **TOL)
    assert_same_weights(model, ref, rtol=1e-4, atol=1e-6)
    assert training.compile_count == 1


@pytest.mark.parametrize("cls", ["SGD", "Adam", "AdamW", "RMSprop", "LAMB"])
def test_ipuxl_optimisers_equal_their_eager_steps(cls):
    torch.manual_seed(1)
    model = MLP()
    ref = copy.deepcopy(model)
    make = getattr(ipuxl.optim, cls)
    kwargs = {"lr": 0.01} if cls != "SGD" else {"lr": 0.1, "momentum": 0.9}
    training = ipuxl.trainingModel(model, Options().deviceIterations(3), optimizer=make(model.parameters(), **kwargs))
    ref_opt = make(ref.parameters(), **kwargs)
    for call in range(2):
        x, y = make_data(3 * 4, seed=call)
        training(x, y)
        eager_steps(ref, ref_opt, x, y, 4)
    assert_same_weights(model, ref, rtol=1e-4, atol=1e-6)


def test_loss_scaling_gives_the_unscaled_update():
    torch.manual_seed(2)
    model = MLP()
    ref = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, Options().deviceIterations(2),
                                   optimizer=ipuxl.optim.SGD(model.parameters(), lr=0.1, loss_scaling=128.0))
    x, y = make_data(8)
    training(x, y)
    eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    assert_same_weights(model, ref)


def test_gradient_accumulation_equals_one_step_on_the_combined_batch():
    torch.manual_seed(3)
    model = MLP()
    ref = copy.deepcopy(model)
    opts = Options().deviceIterations(2)
    opts.Training.gradientAccumulation(3)
    training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5))
    x, y = make_data(2 * 3 * 4)
    out, loss = training(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.5)
    eager_steps(ref, ref_opt, x, y, 3 * 4)  # one step per device iteration, on G micro-batches at once
    assert_same_weights(model, ref, rtol=1e-4, atol=1e-6)
    assert out.shape == (4, 5) and loss.shape == ()


def per_step_reference(x, y, micro: int, n: int):
    torch.manual_seed(4)
    model = MLP()
    ref = copy.deepcopy(model)
    outs, losses = eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, micro)
    return model, outs, losses


@pytest.mark.parametrize("mode,period", [(OutputMode.All, None), (OutputMode.Final, None), (OutputMode.Sum, None),
                                         (OutputMode.EveryN, 2), (OutputMode.Default, None)])
def test_output_modes(mode, period):
    n, micro = 4, 3
    x, y = make_data(n * micro, seed=7)
    model, outs, losses = per_step_reference(x, y, micro, n)
    opts = Options().deviceIterations(n).outputMode(mode, period) if period else Options().deviceIterations(n).outputMode(mode)
    out, loss = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(x, y)
    expected = {
        OutputMode.All: (outs.reshape(n * micro, 5), losses),
        OutputMode.Final: (outs[-1], losses[-1]),
        OutputMode.Default: (outs[-1], losses[-1]),
        OutputMode.Sum: (outs.sum(0), losses.sum(0)),
        OutputMode.EveryN: (outs[1::2].reshape(2 * micro, 5), losses[1::2]),
    }[mode]
    torch.testing.assert_close(out, expected[0], **TOL)
    torch.testing.assert_close(loss, expected[1], **TOL)


def test_anchor_mode_spelling_and_gradient_accumulation_outputs():
    n, g, micro = 2, 2, 3
    x, y = make_data(n * g * micro, seed=8)
    torch.manual_seed(4)
    model = MLP()
    opts = Options().deviceIterations(n).anchorMode(ipuxl.AnchorMode.All)
    opts.Training.gradientAccumulation(g)
    out, loss = ipuxl.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))(x, y)
    assert out.shape == (n * g * micro, 5) and loss.shape == (n * g,)
    with torch.no_grad():  # lr 0: every micro-batch sees the initial weights
        ref_out = model.fc2(torch.tanh(model.fc1(x)))
        ref_loss = torch.stack([nn.functional.cross_entropy(o, t) for o, t in zip(ref_out.split(micro), y.split(micro))])
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(loss, ref_loss, **TOL)


def test_set_optimizer_changes_lr_without_recompiling():
    torch.manual_seed(5)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = ipuxl.trainingModel(model, Options().deviceIterations(2), optimizer=opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data(8)
    training(x, y)
    eager_steps(ref, ref_opt, x, y, 4)
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        group["lr"] = ref_group["lr"] = 0.01
    training.setOptimizer(opt)
    training(x, y)
    eager_steps(ref, ref_opt, x, y, 4)
    assert training.compile_count == 1
    assert_same_weights(model, ref, rtol=1e-4, atol=1e-6)


def test_set_optimizer_with_a_new_structure_recompiles_and_keeps_state():
    torch.manual_seed(6)
    model = MLP()
    ref = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, Options().deviceIterations(2),
                                   optimizer=torch.optim.Adam(model.parameters(), lr=0.01))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    x, y = make_data(8)
    training(x, y)
    eager_steps(ref, ref_opt, x, y, 4)
    # another optimiser type (PopTorch refuses it once compiled): ipuxl recompiles,
    # keeping the weights and the Adam moments AdamW shares
    new = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    new.load_state_dict(ref_opt.state_dict() | {"param_groups": new.state_dict()["param_groups"]})
    ref_new = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    ref_new.load_state_dict(ref_opt.state_dict() | {"param_groups": ref_new.state_dict()["param_groups"]})
    training.setOptimizer(new)
    training(x, y)
    eager_steps(ref, ref_new, x, y, 4)
    assert training.compile_count == 2
    assert_same_weights(model, ref, rtol=1e-4, atol=1e-6)


def test_set_optimizer_refuses_a_changed_constant_attribute():
    """torch.optim.Adam's default weight decay (0) is a constant attribute: changing it
    after compiling is refused as PopTorch refuses it, and the model stays as it was."""
    model = MLP()
    training = ipuxl.trainingModel(model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01))
    x, y = make_data(4)
    training(x, y)
    new = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    with pytest.raises(ipuxl.errors.ExecutorError, match="Problem with weight decays"):
        training.setOptimizer(new)
    assert training.compile_count == 1


def test_optimizer_state_reaches_the_host_optimizer():
    torch.manual_seed(7)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    training = ipuxl.trainingModel(model, Options().deviceIterations(3), optimizer=opt)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    x, y = make_data(12)
    training(x, y)
    eager_steps(ref, ref_opt, x, y, 4)
    training.copyWeightsToHost()
    for p, q in zip(model.parameters(), ref.parameters()):
        mine, theirs = opt.state[p], ref_opt.state[q]
        torch.testing.assert_close(mine["exp_avg"], theirs["exp_avg"], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(mine["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-4, atol=1e-9)
        assert float(mine["step"]) == float(theirs["step"]) == 3.0


def test_unused_and_frozen_parameters_are_not_updated():
    class Partial(MLP):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(3, 3)

    torch.manual_seed(8)
    model = Partial()
    model.fc1.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    training = ipuxl.trainingModel(model, Options().deviceIterations(2), optimizer=opt)
    x, y = make_data(8)
    training(x, y)
    eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1), x, y, 4)
    assert_same_weights(model, ref)
    torch.testing.assert_close(model.unused.weight, ref.unused.weight, rtol=0, atol=0)


def test_loss_argument_and_identity_loss():
    torch.manual_seed(9)
    net = nn.Sequential(nn.Linear(12, 5))
    ref = copy.deepcopy(net)
    training = ipuxl.trainingModel(net, Options().deviceIterations(2), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                   loss=nn.CrossEntropyLoss())
    x, y = make_data(8)
    out, loss = training(x, y)
    assert out.shape == (4, 5) and loss.shape == ()

    class Custom(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            out = self.inner(x)
            return out, ipuxl.identity_loss((out - nn.functional.one_hot(y, 5)) ** 2, reduction="mean")

    custom = Custom(ref)
    ref2 = copy.deepcopy(ref)
    ipuxl.trainingModel(custom, Options().deviceIterations(2), optimizer=torch.optim.SGD(custom.parameters(), lr=0.1))(x, y)
    opt = torch.optim.SGD(ref2.parameters(), lr=0.1)
    for xs, ys in zip(x.split(4), y.split(4)):
        opt.zero_grad()
        ((ref2(xs) - nn.functional.one_hot(ys, 5)) ** 2).mean().backward()
        opt.step()
    assert_same_weights(ref, ref2)


def test_batchnorm_buffers_train_like_eager():
    class BN(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x, y):
            out = self.bn(self.fc(x))
            return out, nn.functional.cross_entropy(out, y)

    torch.manual_seed(10)
    model = BN()
    ref = copy.deepcopy(model)
    x, y = torch.randn(12, 6), torch.randint(0, 4, (12,))
    ipuxl.trainingModel(model, Options().deviceIterations(3), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(x, y)
    eager_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 4)
    assert_same_weights(model, ref)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, **TOL)
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var, **TOL)
    assert int(model.bn.num_batches_tracked) == 3


def test_a_dropped_wrapper_leaves_its_trained_weights_in_the_module():
    """With two replicas in the process the device keeps its own copy of the weights (as on a
    GPU); a wrapper dropped right after its call must not take the trained weights with it."""
    import gc

    torch.manual_seed(3)
    dropped, kept = nn.Sequential(nn.Linear(12, 5)), None
    kept = copy.deepcopy(dropped)
    initial = copy.deepcopy(dropped)
    x, y = make_data(8)

    def wrap(model):
        return ipuxl.trainingModel(model, Options().replicationFactor(2), loss=nn.CrossEntropyLoss(),
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    wrap(dropped)(x, y)  # the wrapper is garbage at once
    gc.collect()
    keeper = wrap(kept)
    keeper(x, y)
    keeper.copyWeightsToHost()
    assert not torch.equal(kept[0].weight, initial[0].weight)  # it trained
    assert_same_weights(dropped, kept, rtol=0, atol=0)
