"""ipuxl.poptorch_compat.optim: PopTorch-style optimisers against torch.optim and references.

With the extras at their defaults the eager step is torch.optim's own, so results are
compared bit for bit. LAMB and the non-default extras (float16 states, AdamW without
bias correction) are compared with independent float64 numpy implementations of the
formula (states rounded to float16 where the optimiser stores them so).
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from ipuxl.errors import InvalidArgumentError
from ipuxl.poptorch_compat import optim as ts

STEPS = 4
EXACT = dict(rtol=0, atol=0)


def _model_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def _data(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 4, generator=g) for _ in range(STEPS)]


def _loss(params, x):
    w, b = params
    return (torch.tanh(x @ w + b) ** 2).mean() + (w * w).sum() * 0.01


def _groups(params, lr2):
    return [{"params": [params[0]]}, {"params": [params[1]], "lr": lr2}]


def _train(make, *, loss_factor: float = 1.0, seed: int = 0):
    params = _model_params(seed)
    opt = make(params)
    for x in _data():
        opt.zero_grad()
        (_loss(params, x) * loss_factor).backward()
        opt.step()
    return [p.detach().clone() for p in params], opt


def _assert_params(got, want, **tol):
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, **tol, msg=lambda m: f"param {i}: {m}")


CASES = [
    (ts.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01), 0.05),
    (ts.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.8, nesterov=True), 0.3),
    (ts.SGD, torch.optim.SGD, dict(lr=0.1), 0.2),
    (ts.Adam, torch.optim.Adam, dict(lr=0.05, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True), 0.01),
    (ts.Adam, torch.optim.Adam, dict(lr=0.05), 0.02),
    (ts.AdamW, torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1), 0.02),
    (ts.RMSprop, torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True, weight_decay=0.1), 0.02),
    (ts.RMSprop, torch.optim.RMSprop, dict(lr=0.01), 0.03),
]


@pytest.mark.parametrize("cls,torch_cls,kw,lr2", CASES, ids=lambda v: getattr(v, "__name__", None))
def test_eager_step_is_torch(cls, torch_cls, kw, lr2):
    got, opt = _train(lambda ps: cls(_groups(ps, lr2), **kw))
    want, ref = _train(lambda ps: torch_cls(_groups(ps, lr2), **kw))
    _assert_params(got, want, **EXACT)
    init = _model_params()
    assert (got[0] - init[0]).abs().max() > 1e-3 and (got[1] - init[1]).abs().max() > 1e-3
    assert opt.param_groups[1]["lr"] == lr2
    # torch's state dict layout and values
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, st in sd["state"].items():
        assert st.keys() == ref_sd["state"][i].keys()
        for k, v in st.items():
            assert_close(v, ref_sd["state"][i][k], **EXACT)


@pytest.mark.parametrize("cls,torch_cls,kw", [
    (ts.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (ts.Adam, torch.optim.Adam, dict(lr=0.05, weight_decay=0.1)),
    (ts.AdamW, torch.optim.AdamW, dict(lr=0.05)),
    (ts.RMSprop, torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
], ids=lambda v: getattr(v, "__name__", None))
def test_loss_scaling_is_ignored_by_the_eager_step(cls, torch_cls, kw):
    # PopTorch's eager step is torch.optim's: loss scaling only acts on the device
    got, opt = _train(lambda ps: cls(_groups(ps, 0.02), loss_scaling=128.0, **kw))
    want, _ = _train(lambda ps: torch_cls(_groups(ps, 0.02), **kw))
    _assert_params(got, want, **EXACT)
    assert opt.loss_scaling == 128.0 and opt.defaults["loss_scaling"] == 128.0
    assert [g["loss_scaling"] for g in opt.param_groups] == [128.0, 128.0]


def test_loss_scaling_is_one_value_per_optimiser():
    params = _model_params()
    with pytest.raises(InvalidArgumentError, match="one value for the whole optimiser"):
        ts.SGD([{"params": [params[0]], "loss_scaling": 4.0}, {"params": [params[1]]}], lr=0.5)
    opt = ts.SGD([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.5, loss_scaling=2.0)
    opt.loss_scaling = 8.0  # PopTorch's attribute: every group follows
    assert [g["loss_scaling"] for g in opt.param_groups] == [8.0, 8.0] and opt.defaults["loss_scaling"] == 8.0
    with pytest.raises(InvalidArgumentError, match="loss_scaling must be a finite number > 0"):
        opt.loss_scaling = -1.0


def test_closure_and_state_dict_round_trip():
    params = _model_params()
    opt = ts.Adam(params, lr=0.01, loss_scaling=2.0, first_order_momentum_accum_type=torch.float32)
    x = _data()[0]

    def closure():
        opt.zero_grad()
        loss = _loss(params, x) * 2.0
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert_close(loss, _loss(_model_params(), x) * 2.0)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["loss_scaling"] == 2.0
    other = ts.Adam(_model_params(), lr=0.5)
    other.load_state_dict(sd)
    assert other.param_groups[0]["loss_scaling"] == 2.0 and other.param_groups[0]["lr"] == 0.01
    assert other.param_groups[0]["first_order_momentum_accum_type"] == torch.float32


# -- LAMB ----------------------------------------------------------------------------------------
def _lamb_reference(w0, grads, *, lr, beta1, beta2, eps, wd, bias_correction=True, max_weight_norm=65500.0):
    """float64 numpy LAMB, written from the formula."""
    w = np.asarray(w0, np.float64).copy()
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = (m / (1 - beta1 ** t), v / (1 - beta2 ** t)) if bias_correction else (m, v)
        u = m_hat / (np.sqrt(v_hat) + eps) + wd * w
        w_norm, u_norm = np.sqrt((w * w).sum()), np.sqrt((u * u).sum())
        r = 1.0 if w_norm == 0 or u_norm == 0 else min(w_norm, max_weight_norm) / u_norm
        w = w - lr * r * u
    return w, m, v


@pytest.mark.parametrize("kw", [
    dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01),
    dict(lr=0.02, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.0, bias_correction=False),
    dict(lr=0.05, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1, max_weight_norm=0.5),  # clipping active
], ids=["default", "no_bias_correction", "max_weight_norm"])
def test_lamb_matches_numpy_reference(kw):
    g = torch.Generator().manual_seed(3)
    w0 = [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]
    grads = [[torch.randn(*w.shape, generator=g) for _ in range(STEPS)] for w in w0]
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    lr2 = kw["lr"] / 2
    opt = ts.LAMB([{"params": [params[0]]}, {"params": [params[1]], "lr": lr2}], **kw)
    for t in range(STEPS):
        for p, gs in zip(params, grads):
            p.grad = gs[t].clone()
        opt.step()
    ref_kw = dict(beta1=kw["betas"][0], beta2=kw["betas"][1], eps=kw["eps"], wd=kw["weight_decay"],
                  bias_correction=kw.get("bias_correction", True),
                  max_weight_norm=kw.get("max_weight_norm", 65500.0))
    for i, (p, lr) in enumerate(zip(params, (kw["lr"], lr2))):
        w, m, v = _lamb_reference(w0[i].numpy(), [x.numpy() for x in grads[i]], lr=lr, **ref_kw)
        assert_close(p.detach().double(), torch.from_numpy(w), rtol=1e-5, atol=1e-6)
        assert (p.detach() - w0[i]).abs().max() > 1e-3
        st = opt.state[p]
        assert_close(st["exp_avg"].double(), torch.from_numpy(m), rtol=1e-5, atol=1e-7)
        assert_close(st["exp_avg_sq"].double(), torch.from_numpy(v), rtol=1e-5, atol=1e-9)
        assert st["step"].dtype == torch.float32 and float(st["step"]) == STEPS


def test_lamb_trust_ratio_is_one_for_zero_weight():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = ts.LAMB([p], lr=0.1, weight_decay=0.0, eps=0.0)
    p.grad = torch.tensor([1.0, -2.0, 4.0])
    opt.step()
    # first step: m_hat = g, v_hat = g*g -> u = sign(g); ||w|| = 0 -> r = 1
    assert_close(p.detach(), torch.tensor([-0.1, 0.1, -0.1]))


def test_lamb_loss_scaling_and_defaults():
    params = _model_params()
    opt = ts.LAMB(params, lr=0.01, loss_scaling=64.0, max_weight_norm=None)
    ref = ts.LAMB(_model_params(), lr=0.01)
    assert opt.defaults["max_weight_norm"] == 65500.0 and opt.defaults["bias_correction"] is True
    assert opt.defaults["weight_decay"] == 1e-2 and opt.defaults["eps"] == 1e-8  # PopTorch's defaults
    for x in _data():  # the eager step ignores the loss scaling
        for o, ps in ((opt, params), (ref, ref.param_groups[0]["params"])):
            o.zero_grad()
            _loss(ps, x).backward()
            o.step()
    _assert_params(params, ref.param_groups[0]["params"], **EXACT)


# -- accum types ----------------------------------------------------------------------------------
def test_accum_types_recorded_per_group_and_in_defaults():
    params = _model_params()
    opt = ts.Adam([{"params": [params[0]]},
                   {"params": [params[1]], "second_order_momentum_accum_type": torch.float32}],
                  accum_type=torch.float16, first_order_momentum_accum_type=torch.float16,
                  second_order_momentum_accum_type=torch.float16)
    assert opt.defaults["accum_type"] is torch.float16
    assert opt.defaults["first_order_momentum_accum_type"] is torch.float16
    assert opt.param_groups[0]["second_order_momentum_accum_type"] is torch.float16
    assert opt.param_groups[1]["second_order_momentum_accum_type"] is torch.float32
    assert opt.param_groups[1]["first_order_momentum_accum_type"] is torch.float16
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float16
    assert opt.state[params[0]]["exp_avg_sq"].dtype == torch.float16
    assert opt.state[params[1]]["exp_avg_sq"].dtype == torch.float32
    sgd = ts.SGD(params, lr=0.1, momentum=0.9, velocity_accum_type=torch.float16)
    assert sgd.param_groups[0]["velocity_accum_type"] is torch.float16 and sgd.defaults["use_combined_accum"] is False
    rms = ts.RMSprop(params, first_order_momentum_accum_type=torch.float16, centered=True)
    lamb = ts.LAMB(params, second_order_momentum_accum_type=torch.float16)
    for o in (sgd, rms, lamb):
        o.step()
    assert sgd.state[params[0]]["momentum_buffer"].dtype == torch.float16
    assert rms.state[params[0]]["square_avg"].dtype == torch.float16
    assert rms.state[params[0]]["grad_avg"].dtype == torch.float32
    assert lamb.state[params[0]]["exp_avg_sq"].dtype == torch.float16
    assert lamb.state[params[0]]["exp_avg"].dtype == torch.float32


def _adam_reference(w0, grads, *, lr, beta1, beta2, eps, wd, decoupled, bias_correction, m_half=False):
    """float64 numpy Adam/AdamW; ``m_half``: m stored rounded to float16."""
    w = np.asarray(w0, np.float64).copy()
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64)
        if decoupled:
            w = w * (1 - lr * wd)
        else:
            g = g + wd * w
        m = beta1 * m + (1 - beta1) * g
        if m_half:
            m = m.astype(np.float16).astype(np.float64)
        v = beta2 * v + (1 - beta2) * g * g
        bc1, bc2 = (1 - beta1 ** t, 1 - beta2 ** t) if bias_correction else (1.0, 1.0)
        w = w - lr / bc1 * m / (np.sqrt(v / bc2) + eps)
    return w


@pytest.mark.parametrize("cls,kw,ref_kw", [
    (ts.AdamW, dict(bias_correction=False, weight_decay=0.1), dict(decoupled=True, bias_correction=False)),
    (ts.AdamW, dict(bias_correction=False, weight_decay=0.1, first_order_momentum_accum_type=torch.float16),
     dict(decoupled=True, bias_correction=False, m_half=True)),
    (ts.Adam, dict(weight_decay=0.1, first_order_momentum_accum_type=torch.float16),
     dict(decoupled=False, bias_correction=True, m_half=True)),
], ids=["adamw_no_bias", "adamw_no_bias_fp16_m", "adam_fp16_m"])
def test_adam_extras_match_numpy_reference(cls, kw, ref_kw):
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(4, 3, generator=g)
    grads = [torch.randn(4, 3, generator=g) for _ in range(STEPS)]
    p = torch.nn.Parameter(w0.clone())
    opt = cls([p], lr=0.01, betas=(0.9, 0.99), eps=1e-8, **kw)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    want = _adam_reference(w0.numpy(), [x.numpy() for x in grads], lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8,
                           wd=0.1, **ref_kw)
    assert_close(p.detach().double(), torch.from_numpy(want), rtol=1e-5, atol=1e-6)
    assert float(opt.state[p]["step"]) == STEPS
    if "first_order_momentum_accum_type" in kw:
        assert opt.state[p]["exp_avg"].dtype == torch.float16


def test_sgd_half_velocity_matches_reference():
    g = torch.Generator().manual_seed(6)
    w0 = torch.randn(5, generator=g)
    grads = [torch.randn(5, generator=g) for _ in range(STEPS)]
    p = torch.nn.Parameter(w0.clone())
    opt = ts.SGD([p], lr=0.1, momentum=0.9, dampening=0.25, velocity_accum_type=torch.float16)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    w, b = w0.numpy().astype(np.float64), None
    for grad in grads:
        gd = grad.numpy().astype(np.float64)
        b = gd if b is None else 0.9 * b + 0.75 * gd
        b = b.astype(np.float16).astype(np.float64)
        w = w - 0.1 * b
    assert_close(p.detach().double(), torch.from_numpy(w), rtol=1e-5, atol=1e-6)
    assert opt.state[p]["momentum_buffer"].dtype == torch.float16


# -- signatures and errors ---------------------------------------------------------------------
@pytest.mark.parametrize("cls,extras", [
    (ts.SGD, ["loss_scaling", "velocity_scaling", "use_combined_accum", "accum_type", "velocity_accum_type",
              "max_grad_norm"]),
    (ts.Adam, ["loss_scaling", "accum_type", "first_order_momentum_accum_type", "second_order_momentum_accum_type",
               "max_grad_norm"]),
    (ts.AdamW, ["loss_scaling", "bias_correction", "accum_type", "first_order_momentum_accum_type",
                "second_order_momentum_accum_type", "max_grad_norm"]),
    (ts.RMSprop, ["loss_scaling", "accum_type", "first_order_momentum_accum_type",
                  "second_order_momentum_accum_type", "use_tf_variant"]),
])
def test_constructor_is_torch_plus_poptorch_extras(cls, extras):
    base = cls.__mro__[2]
    assert base.__module__.startswith("torch.optim") and issubclass(cls, base)
    parent = inspect.signature(base.__init__).parameters
    child = inspect.signature(cls.__init__).parameters
    assert list(child)[:len(parent)] == list(parent)
    for name in parent:
        assert child[name].default == parent[name].default, name
    assert list(child)[len(parent):] == extras


def test_lamb_signature_matches_poptorch():
    params = inspect.signature(ts.LAMB.__init__).parameters
    assert list(params)[1:] == ["params", "lr", "betas", "eps", "weight_decay", "bias_correction", "loss_scaling",
                                "max_weight_norm", "accum_type", "first_order_momentum_accum_type",
                                "second_order_momentum_accum_type"]
    assert isinstance(ts.LAMB(_model_params()), torch.optim.Optimizer)


@pytest.mark.parametrize("make,fragment", [
    (lambda ps: ts.SGD(ps, lr=0.1, max_grad_norm=0.0), "max_grad_norm must be a number > 0"),
    (lambda ps: ts.Adam(ps, max_grad_norm=float("nan")), "max_grad_norm must be a number > 0"),
    (lambda ps: ts.AdamW(ps, max_grad_norm="1"), "max_grad_norm must be a number > 0"),
    (lambda ps: ts.SGD(ps, lr=0.1, momentum=0.9, velocity_scaling=0.0), "velocity_scaling must be a finite number"),
    (lambda ps: ts.Adam(ps, accum_type=torch.bfloat16), "accum_type must be torch.float16 or torch.float32"),
    (lambda ps: ts.LAMB(ps, first_order_momentum_accum_type=torch.float64), "first_order_momentum_accum_type"),
    (lambda ps: ts.SGD(ps, velocity_accum_type="half"), "velocity_accum_type"),
    (lambda ps: ts.RMSprop(ps, use_tf_variant=1), "use_tf_variant must be a bool"),
    (lambda ps: ts.RMSprop(ps, loss_scaling=0.0), "loss_scaling must be a finite number > 0"),
    (lambda ps: ts.LAMB(ps, max_weight_norm=-1.0), "max_weight_norm must be a number >= 0"),
    (lambda ps: ts.AdamW(ps, bias_correction="yes"), "bias_correction must be a bool"),
    (lambda ps: ts.SGD([{"params": ps, "max_grad_norm": 2.0}], lr=0.1), "one value for the whole optimiser"),
])
def test_errors(make, fragment):
    with pytest.raises(InvalidArgumentError, match=None) as info:
        make(_model_params())
    assert fragment in str(info.value)
    assert isinstance(info.value, TypeError)
    assert "fix:" in str(info.value)


def test_lamb_invalid_hyperparameters_raise_value_error_like_torch():
    with pytest.raises(ValueError, match="Invalid learning rate"):
        ts.LAMB(_model_params(), lr=-1.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        ts.LAMB(_model_params(), betas=(0.9, 1.0))


def test_group_added_later_gets_the_extras():
    params = _model_params()
    opt = ts.SGD([params[0]], lr=0.1, loss_scaling=8.0, velocity_accum_type=torch.float16)
    opt.add_param_group({"params": [params[1]], "lr": 0.2})
    assert opt.param_groups[1]["loss_scaling"] == 8.0 and opt.param_groups[1]["velocity_accum_type"] is torch.float16
    with pytest.raises(InvalidArgumentError, match="loss_scaling=4.0"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "loss_scaling": 4.0})
