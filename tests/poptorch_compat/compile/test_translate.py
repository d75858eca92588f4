"""ipuxl.poptorch_compat.compile.translate: torch optimisers -> per-parameter plans, and state both ways.

The state tests run the rules in a real ipuxl program (a weight variable updated from
host-streamed gradients) between eager steps, and check that "eager, device, eager"
trains like "all eager", state dict included.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import InvalidArgumentError
from ipuxl.optim import rules
from ipuxl.poptorch_compat import optim as ts
from ipuxl.poptorch_compat.compile.translate import ParamPlan, initial_state, translate, write_state


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.out = torch.nn.Linear(2, 1, bias=False)


def _net():
    torch.manual_seed(0)
    net = Net()
    return net, {p: n for n, p in net.named_parameters()}


# -- plans -----------------------------------------------------------------------------------------
def test_sgd_plans_two_groups():
    net, names = _net()
    opt = torch.optim.SGD([{"params": [net.fc.weight, net.fc.bias]}, {"params": net.out.parameters(), "lr": 0.5}],
                          lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-4)
    plans = translate(opt, names)
    assert [(p.name, p.group) for p in plans] == [("fc.weight", 0), ("fc.bias", 0), ("out.weight", 1)]
    assert plans[0].rule == "sgd"
    assert plans[0].hypers == {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-4}
    assert plans[2].hypers["lr"] == 0.5
    assert plans[0].flags == {"nesterov": False}
    assert plans[0].state_dtypes == {} and plans[0].loss_scaling == 1.0 and plans[0].grad_accum_dtype is None
    assert set(plans[0].state_specs(net.fc.weight)) == {"momentum_buffer", "step"}
    assert plans[0].structure_key() == plans[2].structure_key()  # only lr differs
    assert len({plans[0], translate(opt, names)[0], plans[1]}) == 2  # plans are hashable values


def test_adam_adamw_rmsprop_plans():
    net, names = _net()
    adam = translate(torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                                      amsgrad=True), names)[0]
    assert adam.rule == "adam"
    assert adam.hypers == {"lr": 0.01, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1}
    assert adam.flags == {"amsgrad": True, "bias_correction": True, "decoupled_weight_decay": False}
    adamw = translate(torch.optim.AdamW(net.parameters()), names)[0]
    assert adamw.flags["decoupled_weight_decay"] is True and adamw.hypers["weight_decay"] == 0.01
    decoupled = translate(torch.optim.Adam(net.parameters(), weight_decay=0.01, decoupled_weight_decay=True),
                          names)[0]
    assert decoupled == adamw
    rms = translate(torch.optim.RMSprop(net.parameters(), alpha=0.9, momentum=0.5, centered=True), names)[0]
    assert rms.rule == "rmsprop"
    assert rms.hypers == {"lr": 0.01, "alpha": 0.9, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.5}
    assert rms.flags == {"centered": True}
    assert set(rms.state_specs(net.fc.weight)) == {"square_avg", "momentum_buffer", "grad_avg"}


def test_poptorch_style_plans_honour_extras():
    net, names = _net()
    lamb = ts.LAMB([{"params": [net.fc.weight]}, {"params": [net.fc.bias, net.out.weight], "lr": 0.2}],
                   lr=0.1, bias_correction=False, max_weight_norm=10.0, loss_scaling=4.0,
                   first_order_momentum_accum_type=torch.float16, accum_type=torch.float16)
    plans = translate(lamb, names)
    assert plans[0].rule == "lamb"
    assert plans[0].hypers == {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01,
                               "max_weight_norm": 10.0}
    assert plans[0].flags == {"bias_correction": False}
    assert plans[0].state_dtypes == {"first_order_dtype": torch.float16}
    assert plans[0].grad_accum_dtype is torch.float16
    assert [p.loss_scaling for p in plans] == [4.0, 4.0, 4.0]
    specs = plans[0].state_specs(net.fc.weight)
    assert specs["first_order"].dtype == torch.float16 and specs["second_order"].dtype == torch.float32
    assert "step" not in specs  # no bias correction
    adamw = translate(ts.AdamW(net.parameters(), bias_correction=False, amsgrad=True,
                               second_order_momentum_accum_type=torch.float16), names)[0]
    assert adamw.flags == {"amsgrad": True, "bias_correction": False, "decoupled_weight_decay": True}
    assert adamw.state_dtypes == {"second_order_dtype": torch.float16, "max_second_order_dtype": torch.float16}
    # float32 accum types for float32 weights are the default: nothing to record in the plan
    assert translate(ts.Adam(net.parameters(), lr=1e-3, first_order_momentum_accum_type=torch.float32), names)[0] \
        .structure_key() == translate(torch.optim.Adam(net.parameters()), names)[0].structure_key()
    sgd = translate(ts.SGD(net.parameters(), lr=0.1, momentum=0.9, velocity_accum_type=torch.float16), names)[0]
    assert sgd.state_dtypes == {"momentum_buffer_dtype": torch.float16}
    no_momentum = translate(ts.SGD(net.parameters(), lr=0.1, velocity_accum_type=torch.float16), names)[0]
    assert no_momentum.state_dtypes == {}  # no momentum buffer: nothing to set
    rms = translate(ts.RMSprop(net.parameters(), centered=True, first_order_momentum_accum_type=torch.float16,
                               second_order_momentum_accum_type=torch.float16), names)[0]
    assert rms.state_dtypes == {"square_avg_dtype": torch.float16, "grad_avg_dtype": torch.float16}


def test_structure_key():
    net, names = _net()

    def key(cls, **kw):
        return translate(cls(net.parameters(), **kw), names)[0].structure_key()

    assert key(torch.optim.SGD, lr=0.1, momentum=0.9) == key(torch.optim.SGD, lr=0.3, momentum=0.5)
    assert key(torch.optim.SGD, lr=0.1, momentum=0.0) != key(torch.optim.SGD, lr=0.1, momentum=0.9)
    assert key(torch.optim.SGD, lr=0.1, weight_decay=0.0) != key(torch.optim.SGD, lr=0.1, weight_decay=0.1)
    assert key(torch.optim.Adam, lr=0.1) == key(torch.optim.Adam, lr=0.01, betas=(0.5, 0.6))
    assert key(torch.optim.Adam, amsgrad=False) != key(torch.optim.Adam, amsgrad=True)
    assert key(torch.optim.Adam) != key(torch.optim.AdamW, weight_decay=0.0)  # decoupled flag
    assert key(ts.Adam, loss_scaling=2.0) == key(ts.Adam, loss_scaling=1024.0)
    assert key(ts.Adam, loss_scaling=2.0) != key(ts.Adam)
    assert key(ts.Adam, first_order_momentum_accum_type=torch.float16) != key(ts.Adam)
    assert key(torch.optim.RMSprop, centered=True) != key(torch.optim.RMSprop)
    assert len({key(torch.optim.RMSprop, lr=0.1), key(torch.optim.RMSprop, lr=0.2)}) == 1  # hashable


def test_tensor_hyperparameters_are_read_exactly_and_frozen_params_planned():
    net, names = _net()
    net.out.weight.requires_grad_(False)
    opt = torch.optim.Adam(net.parameters(), lr=torch.tensor(0.003), betas=(torch.tensor(0.8), torch.tensor(0.9)))
    plans = translate(opt, names)
    assert plans[0].hypers["lr"] == float(torch.tensor(0.003)) and plans[0].hypers["beta1"] == float(
        torch.tensor(0.8))
    assert [p.name for p in plans] == ["fc.weight", "fc.bias", "out.weight"]
    # names given as name -> tensor work too
    assert translate(opt, dict(net.named_parameters())) == plans


def test_plans_run_the_rules_without_rebuilding_state_specs():
    """rule_kwargs() and state_specs() are exactly what the rules accept."""
    net, names = _net()
    for opt in (torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True),
                torch.optim.Adam(net.parameters(), amsgrad=True), ts.LAMB(net.parameters()),
                torch.optim.RMSprop(net.parameters(), momentum=0.1, centered=True)):
        plan = translate(opt, names)[0]
        ir = ipuxl.Ir()
        with ir.main_graph:
            w = ipuxl.variable(np.ones((2, 3), np.float32), ipuxl.float32, name="w")
            g = ipuxl.variable(np.ones((2, 3), np.float32), ipuxl.float32, name="g")
            states = {k: ipuxl.variable(s.zeros(), s.dtype, name=k) for k, s in plan.state_specs(w).items()}
            rules.RULES[plan.rule](w, g, **states, **plan.rule_kwargs())


# -- state ------------------------------------------------------------------------------------------
def _device_steps(plan: ParamPlan, w0: torch.Tensor, states0: dict, grads: list[torch.Tensor]):
    """Run ``len(grads)`` steps of ``plan``'s rule in an ipuxl program; returns (weight, states)."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = len(grads)
    with ir.main_graph:  # the variables, then a device loop whose step loads its gradient
        stream = ipuxl.h2d_stream(tuple(w0.shape), ipuxl.float32, "g")
        w = ipuxl.variable(w0.detach().numpy().copy(), ipuxl.float32, name="w")
        specs = plan.state_specs(w)
        states = {k: ipuxl.variable(states0[k].numpy().copy() if k in states0 else s.zeros(), s.dtype, name=k)
                  for k, s in specs.items()}

        def step(w: ipuxl.TensorByRef, *state_inputs):
            g = ops.host_load(stream)
            if plan.loss_scaling != 1.0:
                g = g * (1.0 / plan.loss_scaling)
            rules.RULES[plan.rule](w, g, **dict(zip(states, state_inputs)), **plan.rule_kwargs())

        held = [w, *states.values()]
        ops.repeat(ir.create_graph(step, *[ipuxl.TensorByRef(v) for v in held]), len(grads), *held)
    session = ipuxl.Session(ir, "cpu")
    with session:
        session.run({stream: np.stack([x.numpy() for x in grads])})
    return (torch.from_numpy(session.get_tensor_data(w).copy()),
            {k: torch.from_numpy(np.array(session.get_tensor_data(v))) for k, v in states.items()})


def _grads(n=5, shape=(3, 4)):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


MAKERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    "lamb": lambda ps: ts.LAMB(ps, lr=0.05),
}
TORCH_STATES = {
    "adam": {"step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32,
             "max_exp_avg_sq": torch.float32},
    "sgd_momentum": {"momentum_buffer": torch.float32},
    "sgd_nesterov": {"momentum_buffer": torch.float32},
    "adamw": {"step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32},
    "rmsprop": {"step": torch.float32, "square_avg": torch.float32, "momentum_buffer": torch.float32,
                "grad_avg": torch.float32},
    "lamb": {"step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32},
}


@pytest.mark.parametrize("kind", list(MAKERS))
def test_eager_then_device_then_eager_equals_all_eager(kind):
    make, grads = MAKERS[kind], _grads()
    w0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(8))
    ref = torch.nn.Parameter(w0.clone())
    ref_opt = make([ref])
    for g in grads:
        ref.grad = g.clone()
        ref_opt.step()

    p = torch.nn.Parameter(w0.clone())
    opt = make([p])
    plan, = translate(opt, {p: "w"})
    assert initial_state(opt, p, plan) == {}  # fresh optimiser
    for g in grads[:2]:
        p.grad = g.clone()
        opt.step()
    states0 = initial_state(opt, p, plan)
    assert set(states0) == set(plan.state_specs(p))
    w, states = _device_steps(plan, p, states0, grads[2:4])
    with torch.no_grad():
        p.copy_(w)
    write_state(opt, p, plan, states, steps_taken=2)
    p.grad = grads[4].clone()
    opt.step()

    assert_close(p.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert (ref.detach() - w0).abs().max() > 1e-2
    sd, ref_sd = opt.state_dict()["state"][0], ref_opt.state_dict()["state"][0]
    assert {k: v.dtype for k, v in sd.items()} == TORCH_STATES[kind]
    assert sd.keys() == ref_sd.keys()
    for k in sd:
        assert_close(sd[k], ref_sd[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")


def test_initial_state_values_and_write_state_round_trip():
    p = torch.nn.Parameter(torch.randn(4, 2, generator=torch.Generator().manual_seed(1)))
    opt = torch.optim.Adam([p], lr=0.1)
    for g in _grads(2, (4, 2)):
        p.grad = g
        opt.step()
    plan, = translate(opt, {p: "p"})
    st = initial_state(opt, p, plan)
    assert set(st) == {"first_order", "second_order", "step"}
    assert st["step"].dtype == torch.float32 and st["step"].shape == () and float(st["step"]) == 2.0
    assert_close(st["first_order"], opt.state[p]["exp_avg"], rtol=0, atol=0)
    assert_close(st["second_order"], opt.state[p]["exp_avg_sq"], rtol=0, atol=0)
    assert st["first_order"] is not opt.state[p]["exp_avg"]  # copies
    exp_avg = opt.state[p]["exp_avg"]
    new = {"first_order": st["first_order"] * 2, "second_order": st["second_order"] * 3,
           "step": torch.tensor(7.0)}
    write_state(opt, p, plan, new)
    assert opt.state[p]["exp_avg"] is exp_avg  # updated in place
    assert_close(opt.state[p]["exp_avg"], new["first_order"], rtol=0, atol=0)
    assert_close(opt.state[p]["exp_avg_sq"], new["second_order"], rtol=0, atol=0)
    assert float(opt.state[p]["step"]) == 7.0 and opt.state[p]["step"].dtype == torch.float32

    sgd_p = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([sgd_p], lr=0.1, momentum=0.9)
    sgd_plan, = translate(sgd, {sgd_p: "b"})
    sgd_p.grad = torch.tensor([1.0, 2.0, 3.0])
    sgd.step()
    sgd_p.grad = torch.tensor([1.0, 0.0, -1.0])
    sgd.step()
    st = initial_state(sgd, sgd_p, sgd_plan)
    assert set(st) == {"momentum_buffer"}  # no dampening: no step counter needed
    assert_close(st["momentum_buffer"], torch.tensor([1.9, 1.8, 1.7]))
    write_state(sgd, sgd_p, sgd_plan, {"momentum_buffer": torch.tensor([5.0, 6.0, 7.0]), "step": torch.tensor(3.0)})
    assert set(sgd.state_dict()["state"][0]) == {"momentum_buffer"}
    assert_close(sgd.state[sgd_p]["momentum_buffer"], torch.tensor([5.0, 6.0, 7.0]))


def test_write_state_into_fresh_optimizer_and_half_states():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = ts.Adam([p], first_order_momentum_accum_type=torch.float16)
    plan, = translate(opt, {p: "p"})
    write_state(opt, p, plan, {"first_order": np.full((2, 2), 0.5, np.float16),
                               "second_order": torch.ones(2, 2), "step": torch.tensor(3.0)})
    st = opt.state_dict()["state"][0]
    assert st["exp_avg"].dtype == torch.float16 and st["exp_avg_sq"].dtype == torch.float32
    assert float(st["step"]) == 3.0
    back = initial_state(opt, p, plan)
    assert back["first_order"].dtype == torch.float16 and float(back["first_order"][0, 0]) == 0.5
    # RMSprop keeps no step in the rule: torch's is advanced by steps_taken
    q = torch.nn.Parameter(torch.zeros(2))
    rms = torch.optim.RMSprop([q])
    rplan, = translate(rms, {q: "q"})
    write_state(rms, q, rplan, {"square_avg": torch.ones(2)}, steps_taken=4)
    write_state(rms, q, rplan, {"square_avg": torch.ones(2)}, steps_taken=3)
    assert float(rms.state[q]["step"]) == 7.0


# -- errors ------------------------------------------------------------------------------------------
def test_unsupported_optimizer():
    net, names = _net()
    with pytest.raises(InvalidArgumentError, match="Adagrad") as info:
        translate(torch.optim.Adagrad(net.parameters()), names)
    assert "torch.optim.SGD" in str(info.value) and "LAMB" in str(info.value)

    class MySGD(torch.optim.SGD):
        def step(self, closure=None):
            return None

    with pytest.raises(InvalidArgumentError, match="overrides step"):
        translate(MySGD(net.parameters(), lr=0.1), names)

    class Plain(torch.optim.Adam):  # a subclass that keeps Adam's step is fine
        pass

    assert translate(Plain(net.parameters()), names)[0].rule == "adam"


def test_parameter_not_in_model():
    net, names = _net()
    stray = torch.nn.Parameter(torch.zeros(2, 5))
    opt = torch.optim.SGD([{"params": [net.fc.weight]}, {"params": [net.fc.bias, stray]}], lr=0.1)
    with pytest.raises(InvalidArgumentError) as info:
        translate(opt, names)
    msg = str(info.value)
    assert "parameter 1 of param group 1" in msg and "(2, 5)" in msg and "model's parameters" in msg


def test_parameter_in_two_groups():
    net, names = _net()
    opt = torch.optim.SGD([{"params": [net.fc.weight]}, {"params": [net.fc.bias]}], lr=0.1)
    opt.param_groups[1]["params"].append(net.fc.weight)  # torch refuses this at construction
    with pytest.raises(InvalidArgumentError, match="also in param group 0"):
        translate(opt, names)


def _with_group(opt, **options):
    opt.param_groups[0].update(options)  # torch checks these at construction only
    return opt


@pytest.mark.parametrize("make,fragment", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize=True is not supported"),
    (lambda ps: torch.optim.Adam(ps, differentiable=True), "differentiable=True is not supported"),
    (lambda ps: _with_group(torch.optim.SGD(ps, lr=0.1), lr=torch.tensor([0.1, 0.2])), "only one-element"),
    (lambda ps: _with_group(torch.optim.SGD(ps, lr=0.1), momentum="0.9"), "momentum must be a number"),
])
def test_unsupported_options(make, fragment):
    net, names = _net()
    with pytest.raises(InvalidArgumentError) as info:
        translate(make(net.parameters()), names)
    assert fragment in str(info.value) and "param group 0" in str(info.value)


def test_ignored_options_and_invalid_group_edits():
    net, names = _net()
    # foreach / capturable / fused are implementation choices
    plain = translate(torch.optim.Adam(net.parameters()), names)
    assert translate(torch.optim.Adam(net.parameters(), foreach=True, capturable=True), names) == plain
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    opt.param_groups[0]["dampening"] = 0.5
    with pytest.raises(InvalidArgumentError, match="Nesterov momentum requires"):
        translate(opt, names)
    popt = ts.Adam([{"params": [net.fc.weight]}, {"params": [net.fc.bias]}], max_grad_norm=2.0)
    assert {p.max_grad_norm for p in translate(popt, names)} == {2.0}
    popt.param_groups[1]["max_grad_norm"] = 1.0
    with pytest.raises(InvalidArgumentError, match="max_grad_norm differs between param groups"):
        translate(popt, names)
    with pytest.raises(InvalidArgumentError, match="unknown state"):
        write_state(opt, net.fc.bias, translate(torch.optim.SGD(net.parameters(), lr=0.1), names)[1],
                    {"exp_avg": torch.zeros(2)})
