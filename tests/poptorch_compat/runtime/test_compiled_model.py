"""setOptimizer as PopTorch: variable optimizer attributes are device variables written
in place (no recompile, eager numbers for any schedule of changes); changing a constant
attribute raises PopART's error. Also: the 2.x autocast API is gone, as in PopTorch 3.x."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import ExecutorError
from ipuxl.poptorch_compat.compile.translate import translate, variable_hypers
from tests.poptorch_compat._checks import eager_micro_steps, mlp_data, raises_in, tanh_mlp

raises = raises_in(__file__)
optim = poptorch.optim
ITERATIONS, MICRO = 2, 4


MLP = tanh_mlp


def data(seed: int):
    return mlp_data(seed, ITERATIONS * MICRO)


def eager_steps(model, opt, x, y):
    eager_micro_steps(model, opt, x, y, MICRO)


def groups(model):
    return [{"params": model.fc1.parameters()}, {"params": model.fc2.parameters()}]


def start(make, seed=0):
    torch.manual_seed(seed)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = make(groups(model))
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(ITERATIONS), optimizer=opt)
    return model, ref, opt, make(groups(ref)), training


def assert_same_weights(a, b, tol):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(p, q, **tol, msg=lambda m: f"{name}: {m}")


# (constructor, [changes per setOptimizer: {group index or "all": {key: value}}], tolerance)
CASES = {
    "SGD": (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, loss_scaling=4.0),
            [{"all": {"momentum": 0.5}, 1: {"weight_decay": 0.05}}, {0: {"dampening": 0.0, "lr": 0.05}},
             {"all": {"momentum": 0.7}, "loss_scaling": 64.0}], dict(rtol=1e-5, atol=1e-6)),
    "Adam": (lambda ps: optim.Adam(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01),
             [{"all": {"betas": (0.8, 0.95)}}, {1: {"weight_decay": 0.1, "eps": 1e-7}}], dict(rtol=1e-4, atol=1e-6)),
    "AdamW": (lambda ps: optim.AdamW(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05),
              [{0: {"betas": (0.7, 0.9)}}, {"all": {"weight_decay": 0.2, "eps": 1e-5}}], dict(rtol=1e-4, atol=1e-6)),
    "RMSprop": (lambda ps: optim.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.5),
                [{"all": {"alpha": 0.8}, 0: {"momentum": 0.3}}, {1: {"weight_decay": 0.1, "eps": 1e-5}}],
                dict(rtol=1e-4, atol=1e-6)),
    "LAMB": (lambda ps: optim.LAMB(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, max_weight_norm=5.0),
             [{"all": {"betas": (0.8, 0.9)}}, {0: {"weight_decay": 0.1, "max_weight_norm": 1.0}}],
             dict(rtol=1e-4, atol=1e-6)),
    "torch.SGD": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
                  [{"all": {"momentum": 0.5}}, {1: {"weight_decay": 0.03, "lr": 0.2}}], dict(rtol=1e-5, atol=1e-6)),
}


def apply(change, *opts):
    for key, values in change.items():
        if key == "loss_scaling":
            opts[0].loss_scaling = values  # the eager step ignores it, as upstream's
            continue
        for opt in opts:
            for index, group in enumerate(opt.param_groups):
                if key in ("all", index):
                    group.update(values)


@pytest.mark.parametrize("case", list(CASES))
def test_variable_attributes_change_in_place_and_train_like_eager(case):
    make, schedule, tol = CASES[case]
    model, ref, opt, ref_opt, training = start(make)
    training(*data(0))
    eager_steps(ref, ref_opt, *data(0))
    session = training.session
    for step, change in enumerate(schedule, start=1):
        apply(change, opt, ref_opt)
        training.setOptimizer(opt)
        training(*data(step))
        eager_steps(ref, ref_opt, *data(step))
    assert training.compile_count == 1 and training.session is session
    assert_same_weights(model, ref, tol)


def test_variable_attributes_are_program_variables():
    model = MLP()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=8.0)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*[t[:MICRO] for t in data(0)])
    names = training.getTensorNames()
    for name in ("optimizer.group0.lr", "optimizer.group0.momentum", "optimizer.loss_scaling"):
        assert name in names
    assert "optimizer.group0.weight_decay" not in names and "optimizer.group0.dampening" not in names


def test_torch_optimizer_constness_follows_poptorch():
    net = MLP()
    names = dict(net.named_parameters())

    def variable(opt):
        return translate(opt, names)[0].variable

    assert variable(torch.optim.SGD(net.parameters(), lr=0.1)) == {"lr"}
    assert variable(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.0)) == {"lr"}
    assert variable(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, dampening=0.1)) == \
        {"lr", "momentum", "dampening"}
    assert variable(torch.optim.AdamW(net.parameters())) == {"lr"}  # weight_decay at AdamW's 0.01
    assert variable(torch.optim.Adam(net.parameters(), weight_decay=0.01, eps=1e-6, betas=(0.5, 0.6))) == \
        {"lr", "weight_decay", "eps"}  # betas always constant
    assert variable(torch.optim.RMSprop(net.parameters(), alpha=0.5)) == {"lr"}  # alpha always constant
    marked = optim.SGD(net.parameters(), lr=0.1, loss_scaling=2.0)
    marked.variable_attrs.markAsConstant("lr")
    marked.variable_attrs.markAsVariable("momentum")
    assert variable(marked) == {"momentum", "loss_scaling"}
    assert variable_hypers(marked, {"lr": 0.1, "beta1": 0.9}, 1.0) == {"loss_scaling"}


def test_changing_a_constant_attribute_raises_like_poptorch():
    model, ref, opt, ref_opt, training = start(lambda ps: torch.optim.Adam(ps, lr=0.01))
    training(*data(0))
    eager_steps(ref, ref_opt, *data(0))
    changed = torch.optim.Adam(groups(model), lr=0.01, betas=(0.5, 0.999))
    with raises(ExecutorError, "Problem with beta1s (param group 0). Values are constant but do not match",
                "beta1=0.9, got 0.5", "markAsVariable('betas')"):
        training.setOptimizer(changed)
    assert training.optimizer is opt  # refused: the model goes on with its optimiser
    training(*data(1))
    eager_steps(ref, ref_opt, *data(1))
    assert training.compile_count == 1
    assert_same_weights(model, ref, dict(rtol=1e-4, atol=1e-6))


def test_changing_constness_or_clipping_raises():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*[t[:MICRO] for t in data(0)])
    opt.param_groups[0]["momentum"] = 0.0  # at torch's default: constant now
    with raises(ExecutorError, "Problem with momentums", "Can not replace a constant value with a non constant value",
                "'momentum' was variable"):
        training.setOptimizer(opt)
    model = MLP()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*[t[:MICRO] for t in data(0)])
    opt.param_groups[0]["weight_decay"] = 0.1  # not passed to the constructor: constant
    with raises(ExecutorError, "Problem with weight decays", "Values are constant",
                "markAsVariable('weight_decay')"):
        training.setOptimizer(opt)
    opt.param_groups[0]["weight_decay"] = 0.0
    clipped = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, max_grad_norm=1.0)
    with raises(ExecutorError, "Clip norm settings do not match", "max_grad_norm=inf, got 1.0"):
        training.setOptimizer(clipped)


def test_marked_variable_before_compiling_can_change():
    def make(ps):
        opt = optim.SGD(ps, lr=0.1, momentum=0.9)
        opt.variable_attrs.markAsVariable("weight_decay")  # before trainingModel, as PopTorch's docs do
        return opt

    model, ref, opt, ref_opt, training = start(make)
    training(*data(0))
    eager_steps(ref, ref_opt, *data(0))
    apply({1: {"weight_decay": 0.2}}, opt, ref_opt)
    training.setOptimizer(opt)
    training(*data(1))
    eager_steps(ref, ref_opt, *data(1))
    assert training.compile_count == 1
    assert_same_weights(model, ref, dict(rtol=1e-5, atol=1e-6))


def test_another_optimizer_type_still_recompiles_and_continues_exactly():
    model, ref, opt, ref_opt, training = start(lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9))
    training(*data(0))
    eager_steps(ref, ref_opt, *data(0))
    adam, ref_adam = optim.Adam(groups(model), lr=0.01), optim.Adam(groups(ref), lr=0.01)
    training.setOptimizer(adam)  # PopTorch refuses another type; ipuxl recompiles
    training(*data(1))
    eager_steps(ref, ref_adam, *data(1))
    assert training.compile_count == 2
    assert_same_weights(model, ref, dict(rtol=1e-4, atol=1e-6))


def test_autocast_api_is_gone_as_in_poptorch_3():
    # deprecated in PopTorch 3.0 (no effect with dispatch tracing), removed in SDK 3.1
    precision = poptorch.Options().Precision
    for name in ("autocastEnabled", "autocastPolicy"):
        with pytest.raises(AttributeError, match=name):
            getattr(precision, name)
    with pytest.raises(AttributeError, match="autocast"):
        poptorch.autocast  # noqa: B018
