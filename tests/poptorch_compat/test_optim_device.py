"""poptorch.optim complete: every optimiser argument on the device against eager steps,
the PopTorch attributes (``loss_scaling``, accumulator dtypes, ``variable_attrs``),
``max_grad_norm``, per-group settings and setOptimizer with and without recompiling."""
from __future__ import annotations

import copy
import logging
import pickle

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import ipuxl
import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import InvalidArgumentError, InvalidValueError, UnsupportedError
from ipuxl.optim import rules
from tests.poptorch_compat._checks import eager_micro_steps, mlp_data, raises_in, tanh_mlp

raises = raises_in(__file__)
optim = poptorch.optim
TOL = dict(rtol=1e-4, atol=1e-6)
ITERATIONS, MICRO = 3, 4


MLP = tanh_mlp


def data(seed: int):
    return mlp_data(seed, ITERATIONS * MICRO)


def eager_steps(model, opt, x, y):
    eager_micro_steps(model, opt, x, y, MICRO)


def pair(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    return model, copy.deepcopy(model)


def assert_same_weights(a: nn.Module, b: nn.Module, **tol):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(p, q, **(tol or TOL), msg=lambda m: f"{name}: {m}")


def train_both(make, ref_make=None, calls: int = 2, seed: int = 0):
    """``calls`` device calls of a trainingModel and the same steps eagerly (with
    ``ref_make``'s optimiser, default the same class): returns both models."""
    model, ref = pair(seed)
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(ITERATIONS), optimizer=make(model))
    ref_opt = (ref_make or make)(ref)
    for call in range(calls):
        x, y = data(call)
        training(x, y)
        eager_steps(ref, ref_opt, x, y)
    assert training.compile_count == 1
    return model, ref


# -- every argument against eager --------------------------------------------------------------
def two_groups(model, **second):
    return [{"params": model.fc1.parameters()}, {"params": model.fc2.parameters(), **second}]


CASES = {
    "sgd_all": lambda m: optim.SGD(two_groups(m, lr=0.05, momentum=0.5), lr=0.1, momentum=0.9, dampening=0.1,
                                   weight_decay=0.01, loss_scaling=64.0),
    "sgd_nesterov": lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.8, nesterov=True),
    "sgd_combined": lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9, use_combined_accum=True,
                                        velocity_scaling=8.0, accum_type=torch.float16),
    "sgd_fp16_velocity": lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.25,
                                             velocity_accum_type=torch.float16),
    "adam_all": lambda m: optim.Adam(two_groups(m, betas=(0.8, 0.99)), lr=0.02, betas=(0.9, 0.995), eps=1e-6,
                                     weight_decay=0.1, loss_scaling=16.0),
    "adam_amsgrad_fp16": lambda m: optim.Adam(m.parameters(), lr=0.02, amsgrad=True,
                                              first_order_momentum_accum_type=torch.float16,
                                              second_order_momentum_accum_type=torch.float16),
    "adamw_no_bias": lambda m: optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.05, bias_correction=False),
    "adamw_groups": lambda m: optim.AdamW(two_groups(m, weight_decay=0.2), lr=0.02, loss_scaling=4.0),
    "rmsprop_all": lambda m: optim.RMSprop(m.parameters(), lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.01,
                                           momentum=0.5, centered=True, loss_scaling=8.0),
    "rmsprop_tf": lambda m: optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5, centered=True, weight_decay=0.01,
                                          use_tf_variant=True),
    "rmsprop_tf_plain": lambda m: optim.RMSprop(m.parameters(), lr=0.01, eps=1e-3, use_tf_variant=True),
    "rmsprop_fp16": lambda m: optim.RMSprop(m.parameters(), lr=0.01, first_order_momentum_accum_type=torch.float16),
    "lamb_all": lambda m: optim.LAMB(two_groups(m, lr=0.02), lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                                     weight_decay=0.05, loss_scaling=32.0, max_weight_norm=0.5),
    "lamb_no_bias": lambda m: optim.LAMB(m.parameters(), lr=0.01, bias_correction=False, max_weight_norm=None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_argument_on_the_device_equals_the_eager_step(name):
    # the eager step of a PopTorch optimiser is torch.optim's (extras at their defaults;
    # tests/optim checks that) or a reference implementation (float16 states, LAMB)
    model, ref = train_both(CASES[name])
    # without bias correction Adam's first steps divide tiny m by tiny sqrt(v): float32
    # rounding differences between the device's and the eager formula grow to ~2e-6
    assert_same_weights(model, ref, **(dict(rtol=1e-4, atol=1e-5) if name == "adamw_no_bias" else TOL))
    assert any((p - q).abs().max() > 1e-3 for p, q in zip(model.parameters(), pair()[0].parameters()))


@pytest.mark.parametrize("make,torch_make", [
    (lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, loss_scaling=128.0),
     lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)),
    (lambda m: optim.Adam(m.parameters(), lr=0.02, weight_decay=0.1, loss_scaling=1024.0),
     lambda m: torch.optim.Adam(m.parameters(), lr=0.02, weight_decay=0.1)),
    (lambda m: optim.AdamW(m.parameters(), lr=0.02, loss_scaling=3.0),
     lambda m: torch.optim.AdamW(m.parameters(), lr=0.02)),
    (lambda m: optim.RMSprop(m.parameters(), lr=0.01, momentum=0.3, loss_scaling=2.0),
     lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.3)),
], ids=["SGD", "Adam", "AdamW", "RMSprop"])
def test_loss_scaling_on_the_device_equals_torch_optim(make, torch_make):
    model, ref = train_both(make, torch_make)
    assert_same_weights(model, ref)


def _lamb_step(params, m, v, t, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01, mwn=65500.0):
    """One LAMB step in float64, from the formula (You et al. 2019; PopTorch's phi = min(., max_weight_norm))."""
    with torch.no_grad():
        for i, p in enumerate(params):
            g = p.grad
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            u = (m[i] / (1 - beta1 ** t)) / ((v[i] / (1 - beta2 ** t)).sqrt() + eps) + wd * p
            r1, r2 = min(p.norm().item(), mwn), u.norm().item()
            p -= lr * (r1 / r2 if r1 > 0 and r2 > 0 else 1.0) * u


def test_lamb_on_the_device_against_a_float64_reference():
    torch.manual_seed(4)
    model = MLP()
    ref = copy.deepcopy(model).double()
    training = poptorch.trainingModel(model, optimizer=optim.LAMB(model.parameters(), lr=0.05, max_weight_norm=1.0))
    params = list(ref.parameters())
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for t in range(1, 4):
        x, y = (d[:MICRO] for d in data(t))
        training(x, y)
        ref.zero_grad()
        ref(x.double(), y)[1].backward()
        _lamb_step(params, m, v, t, lr=0.05, mwn=1.0)
    for p, q in zip(model.parameters(), params):
        assert_close(p.detach().double(), q.detach(), rtol=1e-4, atol=1e-6)
    assert model.fc1.weight.norm() > 1.0  # the max_weight_norm clipping is in play


def test_rmsprop_tf_variant_eager_step_against_a_float64_reference():
    # TensorFlow's RMSprop: mean square starts at one, eps inside the root, lr in the momentum
    torch.manual_seed(9)
    w0, grads = torch.randn(5, dtype=torch.float64), [torch.randn(5, dtype=torch.float64) for _ in range(4)]
    p = nn.Parameter(w0.float())  # float32 weights and states, checked against float64
    opt = optim.RMSprop([p], lr=0.1, alpha=0.9, eps=0.01, momentum=0.5, centered=True, use_tf_variant=True)
    w, ms, mg, mom = w0.clone(), torch.ones(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64), 0.0
    for g in grads:
        p.grad = g.float()
        opt.step()
        ms = 0.9 * ms + 0.1 * g * g
        mg = 0.9 * mg + 0.1 * g
        mom = 0.5 * mom + 0.1 * g / (ms - mg * mg + 0.01).sqrt()
        w = w - mom
    assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)
    fresh = optim.RMSprop([p], use_tf_variant=True)
    assert fresh.use_tf_variant is True


# -- max_grad_norm -------------------------------------------------------------------------------
@pytest.mark.parametrize("cls,kw", [(optim.SGD, dict(lr=0.1, momentum=0.9)), (optim.Adam, dict(lr=0.01)),
                                    (optim.AdamW, dict(lr=0.01))], ids=["SGD", "Adam", "AdamW"])
def test_max_grad_norm_clips_the_global_norm_in_the_eager_step(cls, kw):
    model, ref = pair(5)
    opt = cls(model.parameters(), max_grad_norm=0.05, **kw)
    ref_opt = getattr(torch.optim, cls.__name__)(ref.parameters(), **kw)
    for step in range(3):
        x, y = data(step)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x, y)[1].backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # the user's grads stay
        norm = torch.cat([g.flatten() for g in grads]).norm()
        assert norm > 0.05  # the clipping acts
        with torch.no_grad():  # PopART's factor max_norm / max(norm, max_norm)
            for p in ref.parameters():
                p.grad *= 0.05 / norm
        ref_opt.step()
    assert_same_weights(model, ref)
    assert opt.max_grad_norm == 0.05


def test_max_grad_norm_equals_torch_clip_grad_norm():
    model, ref = pair(6)
    opt = optim.SGD(model.parameters(), lr=0.1, max_grad_norm=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data(0)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x, y)[1].backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    opt.step()
    ref_opt.step()
    assert_same_weights(model, ref, rtol=1e-4, atol=1e-7)  # torch adds 1e-6 to the norm


def test_clip_grad_norm_rule_in_a_graph_equals_torch():
    g0 = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    g1 = np.random.default_rng(1).standard_normal(5).astype(np.float32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        a, b = ipuxl.variable(g0, name="a"), ipuxl.variable(g1, name="b")
        clipped = rules.clip_grad_norm([a, b], 0.5)
        streams = [ipuxl.d2h_stream(t.shape, t.dtype, f"out{i}") for i, t in enumerate(clipped)]
        for s, t in zip(streams, clipped):
            ipuxl.ops.host_store(s, t)
        assert rules.clip_grad_norm([a, b], float("inf")) == [a, b]
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run()
    want = [torch.from_numpy(g0.copy()), torch.from_numpy(g1.copy())]
    norm = torch.cat([w.flatten() for w in want]).norm()
    for w, s in zip(want, streams):
        assert_close(torch.from_numpy(out[s]), w * (0.5 / norm), rtol=1e-5, atol=1e-7)
    with raises(InvalidArgumentError, "max_norm must be a number > 0"):
        rules.clip_grad_norm([], 0.0)


def test_max_grad_norm_on_the_device_equals_the_eager_step():
    model, ref = train_both(lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9, max_grad_norm=0.05,
                                                loss_scaling=16.0))
    assert_same_weights(model, ref)


def test_max_grad_norm_with_adam_on_the_device_equals_the_eager_step():
    model, ref = train_both(lambda m: optim.Adam(m.parameters(), lr=0.01, max_grad_norm=0.02))
    assert_same_weights(model, ref)


# -- PopTorch's attributes ----------------------------------------------------------------------
def test_extras_are_optimizer_attributes_with_poptorch_defaults():
    model = MLP()
    sgd = optim.SGD(model.parameters(), lr=0.1)
    assert (sgd.loss_scaling, sgd.velocity_scaling, sgd.use_combined_accum, sgd.max_grad_norm) == (1.0, 1.0, False,
                                                                                                   float("inf"))
    assert sgd.accum_type is torch.float32 and sgd.velocity_accum_type is torch.float32
    adamw = optim.AdamW(model.parameters())
    assert adamw.bias_correction is True and adamw.first_order_momentum_accum_type is torch.float32
    lamb = optim.LAMB(model.parameters())
    assert lamb.max_weight_norm == 65500.0 and lamb.second_order_momentum_accum_type is torch.float32
    with pytest.raises(AttributeError, match="use_tf_variant"):
        sgd.use_tf_variant
    adamw.bias_correction = False
    assert [g["bias_correction"] for g in adamw.param_groups] == [False]
    assert isinstance(sgd, optim.Optimizer) and isinstance(lamb, optim.Optimizer)
    assert isinstance(sgd, torch.optim.SGD) and isinstance(lamb, torch.optim.Optimizer)


def test_float16_weights_keep_float32_states_by_default():
    p = nn.Parameter(torch.randn(4, dtype=torch.float16))
    opt = optim.Adam([p], lr=0.01)
    p.grad = torch.randn(4, dtype=torch.float16)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and opt.state[p]["exp_avg_sq"].dtype == torch.float32
    assert p.dtype == torch.float16


def test_variable_attrs_record_the_explicit_arguments():
    model = MLP()
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9, loss_scaling=2.0)
    attrs = opt.variable_attrs
    assert isinstance(attrs, optim.VariableAttributes)
    assert not attrs.isConstant("lr") and not attrs.isConstant("momentum") and not attrs.isConstant("loss_scaling")
    assert attrs.isConstant("weight_decay") and attrs.isConstant("dampening")
    attrs.markAsVariable("weight_decay")
    attrs.markAsConstant("lr")
    assert not attrs.isConstant("weight_decay") and attrs.isConstant("lr")
    with raises(InvalidValueError, "Unknown attribute 'betas'", "allowed values"):
        attrs.markAsVariable("betas")
    lamb = optim.LAMB(model.parameters(), bias_correction=False)
    assert not lamb.variable_attrs.isConstant("bias_correction") and lamb.variable_attrs.isConstant("lr")
    copied = pickle.loads(pickle.dumps(opt))
    assert copied.variable_attrs.isConstant("lr") and copied.loss_scaling == 2.0


def test_velocity_scaling_without_combined_accum_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        optim.SGD(MLP().parameters(), lr=0.1, velocity_scaling=4.0)
    assert "velocity_scaling value ignored" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        optim.SGD(MLP().parameters(), lr=0.1, velocity_scaling=4.0, use_combined_accum=True)
    assert "velocity_scaling" not in caplog.text


# -- setOptimizer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: optim.Adam(ps, lr=0.02),
    lambda ps: optim.AdamW(ps, lr=0.02), lambda ps: optim.RMSprop(ps, lr=0.01, centered=True),
    lambda ps: optim.LAMB(ps, lr=0.02), lambda ps: torch.optim.Adam(ps, lr=0.02),
], ids=["SGD", "Adam", "AdamW", "RMSprop", "LAMB", "torch.Adam"])
def test_set_optimizer_new_learning_rates_do_not_recompile(make):
    model, ref = pair(7)
    opt = make(two_groups(model))
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(ITERATIONS), optimizer=opt)
    ref_opt = make(two_groups(ref))
    x, y = data(0)
    training(x, y)
    eager_steps(ref, ref_opt, x, y)
    for o in (opt, ref_opt):
        o.param_groups[0]["lr"] *= 0.5
        o.param_groups[1]["lr"] *= 2.0
    training.setOptimizer(opt)
    x, y = data(1)
    training(x, y)
    eager_steps(ref, ref_opt, x, y)
    assert training.compile_count == 1
    assert_same_weights(model, ref)


def test_set_optimizer_other_changes_recompile_and_continue_exactly():
    # variable attributes (passed to the constructor: loss_scaling, momentum) are
    # written in place; another optimiser type, which PopTorch refuses once compiled,
    # recompiles in ipuxl, keeping weights and optimiser state
    model, ref = pair(8)
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=4.0)
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(ITERATIONS), optimizer=opt)
    ref_opt = optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = data(0)
    training(x, y)
    eager_steps(ref, ref_opt, x, y)
    opt.loss_scaling = 64.0
    for group in opt.param_groups + ref_opt.param_groups:
        group["momentum"] = 0.5
    training.setOptimizer(opt)
    training(*data(1))
    eager_steps(ref, ref_opt, *data(1))
    assert training.compile_count == 1
    assert_same_weights(model, ref)
    adam, ref_adam = optim.Adam(model.parameters(), lr=0.01), optim.Adam(ref.parameters(), lr=0.01)
    training.setOptimizer(adam)  # another optimiser type
    training(*data(2))
    eager_steps(ref, ref_adam, *data(2))
    assert training.compile_count == 2
    assert_same_weights(model, ref)


def test_set_optimizer_refuses_group_edits_that_break_global_attributes():
    model = MLP()
    opt = optim.Adam(two_groups(model), lr=0.01, loss_scaling=8.0)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*[t[:MICRO] for t in data(0)])
    opt.param_groups[1]["loss_scaling"] = 2.0
    with raises(InvalidArgumentError, "loss_scaling differs between param groups", "[8.0, 2.0]"):
        training.setOptimizer(opt)


@pytest.mark.parametrize("make", [lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
                                  lambda ps, lr: torch.optim.AdamW(ps, lr=lr)], ids=["SGD", "AdamW"])
def test_a_float64_model_takes_its_learning_rate_in_double_precision(make):
    """Eager torch.optim applies a Python learning rate in double precision to float64
    weights; the device's learning-rate variable of a float64 group is float64 (a float32 one
    rounded 0.01 to 0.0099999998, a relative error of 2e-8 that deep BatchNorm nets
    amplified into visible loss differences). Also after setOptimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters(), 0.01), make(ref.parameters(), 0.01)
    training = poptorch.trainingModel(_WithMSE(model), optimizer=opt)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for step in range(4):
        if step == 2:
            for o in (opt, ref_opt):
                o.param_groups[0]["lr"] = 0.003
            training.setOptimizer(opt)
        training(x, y)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    training.copyWeightsToHost()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), rtol=1e-13, atol=1e-15)


class _WithMSE(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        return out, nn.functional.mse_loss(out, y)
