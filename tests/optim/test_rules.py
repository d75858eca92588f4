"""ipuxl.optim.rules against torch.optim (eager PyTorch is the oracle).

Each test builds ONE ipuxl training program for a 6-8-4 tanh MLP with a mean squared
error loss (forward subgraph, ``transforms.autodiff``, grad call, then a rule applied
to every weight with zero-initialised state variables), trains it for 10 steps on
fresh random data per step, and compares every weight with the same model trained
by ``torch.optim`` (same init, data and hyperparameters) or, where torch has no such
optimiser (LAMB, Adam without bias correction, float16 state), by a plain-PyTorch
implementation of the formula written here.

Tolerance: rtol=1e-4, atol=1e-5 (float32). The programs differ from eager torch only
in the order of float32 roundings (fused ``addcdiv``/``lerp`` in torch, separate ops
here; bias corrections in float32 here, Python floats in torch), ~1e-7 relative per
step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl import transforms
from ipuxl.errors import InvalidArgumentError
from ipuxl.optim import rules

STEPS, BATCH = 10, 8
SHAPES = {"w0": (6, 8), "b0": (8,), "w1": (8, 4), "b1": (4,)}
F32 = ipuxl.float32
RTOL, ATOL = 1e-4, 1e-5


# -- the model -------------------------------------------------------------------------------
def _loss_ipuxl(x, y, w0, b0, w1, b1):
    d = ops.tanh(x @ w0 + b0) @ w1 + b1 - y
    return ops.mean(d * d)


def _loss_torch(x, y, w0, b0, w1, b1):
    d = torch.tanh(x @ w0 + b0) @ w1 + b1 - y
    return torch.mean(d * d)


def _init(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (0.5 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _data(seed: int = 1, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((steps, BATCH, 6)).astype(np.float32),
            rng.standard_normal((steps, BATCH, 4)).astype(np.float32))


class Program:
    """One ipuxl training program: forward + autodiff + grad call + ``rule`` on every weight.

    Hyperparameters named in ``streamed`` are scalar tensors loaded from host streams
    (one value per step), those in ``variables`` scalar variables; the rest are numbers.
    """

    def __init__(self, rule: str, init: dict[str, np.ndarray], options: dict, *, streamed=(), variables=(),
                 state_dtypes: dict | None = None, steps_per_run: int = STEPS):
        self.n = steps_per_run
        ir = ipuxl.Ir()
        ir.num_host_transfers = steps_per_run
        with ir.main_graph:  # the variables, then the device loop: ops.repeat of one training step
            self.x_stream = ipuxl.h2d_stream((BATCH, 6), F32, "x")
            self.y_stream = ipuxl.h2d_stream((BATCH, 4), F32, "y")
            self.weights = {k: ipuxl.variable(a, F32, name=k) for k, a in init.items()}
            self.hyper_streams = {k: ipuxl.h2d_stream((), F32, k) for k in streamed}
            self.hyper_vars = {k: ipuxl.variable(np.float32(options[k]), F32, name=k) for k in variables}
            self.states: dict[str, dict[str, ipuxl.Tensor]] = {}
            for name, w in self.weights.items():
                specs = rules.state_specs(rule, w, **options, **(state_dtypes or {}))
                self.states[name] = {k: ipuxl.variable(spec.zeros(), spec.dtype, name=f"{name}_{k}")
                                     for k, spec in specs.items()}
            held = [*self.weights.values(), *self.hyper_vars.values(),
                    *(v for states in self.states.values() for v in states.values())]

            def step(*inputs):
                mine = dict(zip(held, inputs))
                x, y = ops.host_load(self.x_stream), ops.host_load(self.y_stream)
                hypers = dict(options)
                hypers.update({k: ops.host_load(s) for k, s in self.hyper_streams.items()})
                hypers.update({k: mine[v] for k, v in self.hyper_vars.items()})
                ws = [mine[w] for w in self.weights.values()]
                graph = ir.create_graph(_loss_ipuxl, x, y, *ws)
                call = ops.call_with_info(graph, x, y, *ws)
                info = transforms.autodiff(graph, grads_required=graph.inputs[2:])
                grads = ops.call(info.graph, ipuxl.constant(np.float32(1.0)), inputs_dict=info.inputs_dict(call))
                for (name, w), g in zip(self.weights.items(), grads):
                    states = {k: mine[v] for k, v in self.states[name].items()}
                    rules.RULES[rule](mine[w], g, **states, **hypers)

            loop = ir.create_graph(step, *[ipuxl.TensorByRef(v) for v in held])
            ops.repeat(loop, steps_per_run, *held)
        self.ir = ir
        self.session = ipuxl.Session(ir, "cpu")

    def run(self, x: np.ndarray, y: np.ndarray, **hyper_values) -> None:
        """Run ``steps_per_run`` steps; ``hyper_values``: a number or one value per step per stream."""
        feeds = {self.x_stream: x, self.y_stream: y}
        for k, s in self.hyper_streams.items():
            values = np.broadcast_to(np.asarray(hyper_values[k], np.float32), (self.n,))
            feeds[s] = values.copy() if self.n > 1 else values.reshape(())
        with self.session:
            self.session.run(feeds)

    def weight_values(self) -> dict[str, np.ndarray]:
        return {k: self.session.get_tensor_data(v).copy() for k, v in self.weights.items()}

    def state_value(self, weight: str, state: str) -> np.ndarray:
        return self.session.get_tensor_data(self.states[weight][state]).copy()


# -- references ---------------------------------------------------------------------------------
def _torch_optimizer(rule: str, options: dict):
    opts = dict(options)
    if rule in ("adam", "adamw"):
        opts["betas"] = (opts.pop("beta1", 0.9), opts.pop("beta2", 0.999))
        return lambda params: (torch.optim.AdamW if rule == "adamw" else torch.optim.Adam)(params, **opts)
    cls = {"sgd": torch.optim.SGD, "rmsprop": torch.optim.RMSprop}[rule]
    return lambda params: cls(params, **opts)


class _Formula(torch.optim.Optimizer):
    """A plain-PyTorch optimiser from an update function ``update(p, g, state, t, group)``."""

    def __init__(self, params, update, **defaults):
        super().__init__(params, defaults)
        self.update = update

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["t"] = state.get("t", 0) + 1
                self.update(p, p.grad, state, state["t"], group)


def _lamb_update(p, g, state, t, group):
    beta1, beta2, eps, wd = group["beta1"], group["beta2"], group["eps"], group["weight_decay"]
    m = state.setdefault("m", torch.zeros_like(p))
    v = state.setdefault("v", torch.zeros_like(p))
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    m_hat, v_hat = (m / (1 - beta1 ** t), v / (1 - beta2 ** t)) if group["bias_correction"] else (m, v)
    u = m_hat / (v_hat.sqrt() + eps) + wd * p
    w_norm, u_norm = p.norm(), u.norm()
    if group["max_weight_norm"] is not None:
        w_norm = w_norm.clamp(max=group["max_weight_norm"])
    ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
    p.sub_(group["lr"] * ratio * u)


def _adam_update(p, g, state, t, group):
    """Adam's formula (L2 weight decay), optionally without bias correction / with float16 m."""
    beta1, beta2, eps = group["beta1"], group["beta2"], group["eps"]
    g = g + group["weight_decay"] * p
    m = state.setdefault("m", torch.zeros_like(p, dtype=group["m_dtype"]))
    v = state.setdefault("v", torch.zeros_like(p))
    m.copy_((beta1 * m.float() + (1 - beta1) * g).to(m.dtype))  # computed in float32, rounded when stored
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    m_hat, v_hat = m.float(), v
    if group["bias_correction"]:
        m_hat, v_hat = m_hat / (1 - beta1 ** t), v_hat / (1 - beta2 ** t)
    p.sub_(group["lr"] * m_hat / (v_hat.sqrt() + eps))


_FORMULA_DEFAULTS = {
    "lamb": (_lamb_update, dict(beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0, bias_correction=True,
                                max_weight_norm=None)),
    "adam": (_adam_update, dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, bias_correction=True,
                                m_dtype=torch.float32)),
}


def _formula_optimizer(rule: str, options: dict, **extra):
    update, defaults = _FORMULA_DEFAULTS[rule]
    return lambda params: _Formula(params, update, **{**defaults, **options, **extra})


def _train_reference(make_optimizer, init, x, y, lrs=None, optimizer=None):
    """Train the MLP eagerly; returns (final weights, params, optimizer)."""
    params = optimizer.param_groups[0]["params"] if optimizer else [
        torch.nn.Parameter(torch.from_numpy(a.copy())) for a in init.values()]
    optimizer = optimizer or make_optimizer(params)
    for i in range(len(x)):
        if lrs is not None:
            for group in optimizer.param_groups:
                group["lr"] = float(np.float32(lrs[i]))
        optimizer.zero_grad()
        _loss_torch(torch.from_numpy(x[i]), torch.from_numpy(y[i]), *params).backward()
        optimizer.step()
    return {k: p.detach().clone() for k, p in zip(init, params)}, optimizer


def _assert_trained_like(got: dict, want: dict, init: dict, rtol=RTOL, atol=ATOL) -> None:
    for k in init:
        assert_close(torch.from_numpy(got[k]), want[k], rtol=rtol, atol=atol, msg=lambda m: f"weight {k}: {m}")
        moved = np.abs(got[k] - init[k]).max()
        assert moved > 1e-3, f"weight {k} barely changed ({moved}): the comparison would prove nothing"


def _check(rule: str, options: dict, reference, *, streamed=(), lrs=None, **program_kw) -> Program:
    init, (x, y) = _init(), _data()
    program = Program(rule, init, options, streamed=streamed, **program_kw)
    hyper_values = {k: options[k] for k in streamed}
    if lrs is not None:
        hyper_values["lr"] = lrs
    program.run(x, y, **hyper_values)
    want, _ = _train_reference(reference, init, x, y, lrs)
    _assert_trained_like(program.weight_values(), want, init)
    return program


# -- torch.optim rules -----------------------------------------------------------------------------
SGD_CASES = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.1, momentum=0.9),
    "dampening": dict(lr=0.1, momentum=0.9, dampening=0.3),
    "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
    "weight_decay": dict(lr=0.1, weight_decay=0.05),
    "momentum-dampening-weight_decay": dict(lr=0.1, momentum=0.8, dampening=0.2, weight_decay=0.05),
    "nesterov-weight_decay": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
}
ADAM_CASES = {
    "plain": dict(lr=0.05),
    "betas-eps": dict(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-3),
    "weight_decay": dict(lr=0.05, weight_decay=0.1),
    "amsgrad": dict(lr=0.05, amsgrad=True),
    "amsgrad-weight_decay": dict(lr=0.05, amsgrad=True, weight_decay=0.1, beta2=0.9),
}
ADAMW_CASES = {
    "weight_decay": dict(lr=0.05, weight_decay=0.1, decoupled_weight_decay=True),
    "amsgrad": dict(lr=0.05, weight_decay=0.5, decoupled_weight_decay=True, amsgrad=True),
}
RMSPROP_CASES = {
    "plain": dict(lr=0.01),
    "momentum": dict(lr=0.01, momentum=0.9),
    "centered": dict(lr=0.01, centered=True),
    "weight_decay": dict(lr=0.01, weight_decay=0.1),
    "centered-momentum-weight_decay-alpha": dict(lr=0.01, alpha=0.9, centered=True, momentum=0.5,
                                                 weight_decay=0.1, eps=1e-4),
}


@pytest.mark.parametrize("options", SGD_CASES.values(), ids=SGD_CASES.keys())
def test_sgd_matches_torch(options):
    _check("sgd", options, _torch_optimizer("sgd", options))


@pytest.mark.parametrize("options", ADAM_CASES.values(), ids=ADAM_CASES.keys())
def test_adam_matches_torch(options):
    _check("adam", options, _torch_optimizer("adam", options))


@pytest.mark.parametrize("options", ADAMW_CASES.values(), ids=ADAMW_CASES.keys())
def test_adamw_matches_torch(options):
    torch_options = {k: v for k, v in options.items() if k != "decoupled_weight_decay"}
    _check("adamw", options, _torch_optimizer("adamw", torch_options))


@pytest.mark.parametrize("options", RMSPROP_CASES.values(), ids=RMSPROP_CASES.keys())
def test_rmsprop_matches_torch(options):
    _check("rmsprop", options, _torch_optimizer("rmsprop", options))


# -- formulas torch.optim does not have ---------------------------------------------------------------
@pytest.mark.parametrize("options", [dict(lr=0.01, bias_correction=False),
                                     dict(lr=0.01, bias_correction=False, weight_decay=0.1, beta1=0.8)],
                         ids=["plain", "weight_decay"])
def test_adam_without_bias_correction_matches_formula(options):
    program = _check("adam", options, _formula_optimizer("adam", options))
    assert "step" not in program.states["w0"]


LAMB_CASES = {
    "plain": dict(lr=0.05),
    "weight_decay": dict(lr=0.05, weight_decay=0.1, beta1=0.8, beta2=0.99, eps=1e-4),
    "max_weight_norm": dict(lr=0.05, weight_decay=0.1, max_weight_norm=1.5),
    "no_bias_correction": dict(lr=0.02, weight_decay=0.1, bias_correction=False),
}


@pytest.mark.parametrize("options", LAMB_CASES.values(), ids=LAMB_CASES.keys())
def test_lamb_matches_formula(options):
    _check("lamb", options, _formula_optimizer("lamb", options))


def test_lamb_max_weight_norm_clips():
    init, (x, y) = _init(), _data()
    results = []
    for options in (dict(lr=0.05), dict(lr=0.05, max_weight_norm=1.5)):
        program = Program("lamb", init, options)
        program.run(x, y)
        results.append(program.weight_values())
    assert np.linalg.norm(init["w0"]) > 1.5  # w0 is clipped: its step differs
    assert not np.allclose(results[0]["w0"], results[1]["w0"], rtol=1e-3, atol=1e-4)


# -- hyperparameters as tensors ---------------------------------------------------------------------------
TENSOR_CASES = {
    "sgd": (dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.05), ("momentum", "dampening", "weight_decay")),
    "sgd-nesterov": (dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05), ("momentum", "weight_decay")),
    "adam": (dict(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, amsgrad=True),
             ("beta1", "beta2", "eps", "weight_decay")),
    "adamw": (dict(lr=0.05, weight_decay=0.3, decoupled_weight_decay=True), ("weight_decay",)),
    "rmsprop": (dict(lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.5, centered=True),
                ("alpha", "eps", "weight_decay", "momentum")),
    "lamb": (dict(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-5, weight_decay=0.1, max_weight_norm=1.5),
             ("beta1", "beta2", "eps", "weight_decay", "max_weight_norm")),
}


@pytest.mark.parametrize("case", TENSOR_CASES.keys())
def test_tensor_hyperparameters_with_a_per_step_lr_schedule(case):
    """Every hyperparameter a scalar tensor from a host stream; lr changes every step."""
    options, streamed = TENSOR_CASES[case]
    rule = case.split("-")[0]
    lrs = np.linspace(options["lr"], options["lr"] / 5, STEPS)
    if rule == "lamb":
        reference = _formula_optimizer("lamb", options)
    else:
        reference = _torch_optimizer(rule, {k: v for k, v in options.items() if k != "decoupled_weight_decay"})
    _check(rule, options, reference, streamed=("lr", *streamed), lrs=lrs)


def test_streamed_lr_changed_between_runs_takes_effect():
    options = dict(lr=0.1, momentum=0.9, dampening=0.1)
    init, (x, y) = _init(), _data(steps=15)
    program = Program("sgd", init, options, streamed=("lr",), steps_per_run=5)
    torch_opt = None
    for run, lr in enumerate([0.1, 0.0, 0.03]):
        before = program.weight_values()
        program.run(x[5 * run:5 * run + 5], y[5 * run:5 * run + 5], lr=lr)
        want, torch_opt = _train_reference(_torch_optimizer("sgd", options), init, x[5 * run:5 * run + 5],
                                           y[5 * run:5 * run + 5], [lr] * 5, torch_opt)
        got = program.weight_values()
        for k in init:
            assert_close(torch.from_numpy(got[k]), want[k], rtol=RTOL, atol=ATOL)
            if lr == 0.0:  # the weights stand still, the momentum buffer does not
                np.testing.assert_array_equal(got[k], before[k])
            else:
                assert np.abs(got[k] - before[k]).max() > 1e-3
    assert program.state_value("w0", "step") == 15.0


def test_variable_lr_written_between_runs_takes_effect():
    options = dict(lr=0.05, weight_decay=0.1)
    init, (x, y) = _init(), _data()
    program = Program("adam", init, options, variables=("lr",), steps_per_run=5)
    program.run(x[:5], y[:5])
    with program.session:
        program.session.write_variable_data(program.hyper_vars["lr"], np.float32(0.01))
    program.run(x[5:], y[5:])
    want, _ = _train_reference(_torch_optimizer("adam", options), init, x, y, [0.05] * 5 + [0.01] * 5)
    _assert_trained_like(program.weight_values(), want, init)
    want_unchanged, _ = _train_reference(_torch_optimizer("adam", options), init, x, y)
    assert not np.allclose(program.weight_values()["w0"], want_unchanged["w0"].numpy(), rtol=1e-3, atol=1e-4)


# -- state dtypes ------------------------------------------------------------------------------------------
def test_adam_float16_first_order_matches_rounded_formula():
    """m stored as float16 (computed in float32, rounded when stored), v and the weights float32.

    Tolerance rtol=1e-3, atol=1e-4: a float32 rounding difference before the float16
    rounding of m (gradients from different code) can flip m by one float16 ulp
    (2**-11 relative), changing that step's update by ~5e-4 * lr.
    """
    options = dict(lr=0.05, weight_decay=0.05)
    init, (x, y) = _init(), _data()
    program = Program("adam", init, options, state_dtypes={"first_order_dtype": ipuxl.float16})
    assert program.states["w0"]["first_order"].dtype == ipuxl.float16
    assert program.states["w0"]["second_order"].dtype == ipuxl.float32
    program.run(x, y)
    want, formula = _train_reference(_formula_optimizer("adam", options, m_dtype=torch.float16), init, x, y)
    got = program.weight_values()
    for k in init:
        assert_close(torch.from_numpy(got[k]), want[k], rtol=1e-3, atol=1e-4)
    params = formula.param_groups[0]["params"]
    m_ref = formula.state[params[0]]["m"]
    m_got = program.state_value("w0", "first_order")
    assert m_got.dtype == np.float16
    assert_close(torch.from_numpy(m_got), m_ref, rtol=2e-3, atol=1e-4)
    # float16 storage really happened: float32 Adam ends elsewhere
    want32, _ = _train_reference(_torch_optimizer("adam", options), init, x, y)
    assert any(not np.array_equal(got[k], want32[k].numpy()) for k in init)


def test_adam_float16_states_keep_large_gradients_finite():
    """v_hat = v / (1 - beta2) = g**2 overflows float16 for |g| > 256: the update is computed in float32."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        g_stream = ipuxl.h2d_stream((3,), F32, "g")
        w = ipuxl.variable(np.zeros(3, np.float32), name="w")
        specs = rules.state_specs("adam", w, first_order_dtype=ipuxl.float16, second_order_dtype=ipuxl.float16)
        states = {k: ipuxl.variable(s.zeros(), s.dtype, name=k) for k, s in specs.items()}
        rules.adam_(w, ops.host_load(g_stream), **states, lr=0.1)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({g_stream: np.array([300.0, -300.0, 1.0], np.float32)})
        got = session.get_tensor_data(w)
    # Step 1: m_hat = g, v_hat = g**2, so w = -lr * g / (|g| + eps).
    assert_close(torch.from_numpy(got), torch.tensor([-0.1, 0.1, -0.1]), rtol=1e-3, atol=0)


# -- state_specs, errors, structure -------------------------------------------------------------------------
def test_state_specs_name_the_rule_arguments():
    w = ipuxl.TensorSpec((4, 3), F32)
    names = lambda rule, **o: list(rules.state_specs(rule, w, **o))  # noqa: E731
    assert names("sgd", lr=0.1) == []
    assert names("sgd", lr=0.1, momentum=0.9) == ["momentum_buffer"]
    assert names("sgd_", lr=0.1, momentum=0.9, dampening=0.1) == ["momentum_buffer", "step"]
    assert names("adam") == ["first_order", "second_order", "step"]
    assert names("adamw", amsgrad=True) == ["first_order", "second_order", "step", "max_second_order"]
    assert names(rules.adam_, bias_correction=False) == ["first_order", "second_order"]
    assert names("lamb", max_weight_norm=1.0) == ["first_order", "second_order", "step"]
    assert names("rmsprop") == ["square_avg"]
    assert names("rmsprop", momentum=0.9, centered=True) == ["square_avg", "momentum_buffer", "grad_avg"]
    specs = rules.state_specs("adam", w, first_order_dtype=ipuxl.float16)
    assert specs["first_order"] == ((4, 3), ipuxl.float16)
    shape, dtype = specs["second_order"]
    assert (shape, dtype) == ((4, 3), ipuxl.float32)
    assert specs["step"] == ((), ipuxl.float32)
    assert specs["step"].zeros().dtype == np.float32 and specs["step"].zeros().shape == ()
    with pytest.raises(InvalidArgumentError, match="unknown options"):
        rules.state_specs("adam", w, momentum=0.9)
    with pytest.raises(InvalidArgumentError, match="unknown optimiser rule"):
        rules.state_specs("adagrad", w)


def _build(fn):
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.ones((2, 3), np.float32), name="w")
        g = ipuxl.variable(np.ones((2, 3), np.float32), name="g")
        buf = ipuxl.variable(np.zeros((2, 3), np.float32), name="buf")
        lr = ipuxl.variable(np.float32(0.1), name="lr")
        n_before = len(ir.main_graph.fx.nodes)
        fn(w, g, buf, lr)
        return [n.meta.get("ipuxl_op") for n in list(ir.main_graph.fx.nodes)[n_before:]]


def test_rule_errors_say_what_is_missing():
    with pytest.raises(InvalidArgumentError, match="momentum_buffer"):
        _build(lambda w, g, buf, lr: rules.sgd_(w, g, lr=0.1, momentum=0.9))
    with pytest.raises(InvalidArgumentError, match="dampening needs the `step`"):
        _build(lambda w, g, buf, lr: rules.sgd_(w, g, lr=0.1, momentum=0.9, dampening=0.1, momentum_buffer=buf))
    with pytest.raises(InvalidArgumentError, match="Nesterov"):
        _build(lambda w, g, buf, lr: rules.sgd_(w, g, lr=0.1, nesterov=True))
    with pytest.raises(InvalidArgumentError, match="max_second_order"):
        _build(lambda w, g, buf, lr: rules.adam_(w, g, buf, buf, lr, lr=0.1, amsgrad=True))
    with pytest.raises(InvalidArgumentError, match="`step`"):
        _build(lambda w, g, buf, lr: rules.lamb_(w, g, buf, buf, lr=0.1))
    with pytest.raises(InvalidArgumentError, match="scalar float tensor"):
        _build(lambda w, g, buf, lr: rules.rmsprop_(w, g, buf, lr=g))
    with pytest.raises(InvalidArgumentError, match="beta2"):
        _build(lambda w, g, buf, lr: rules.adam_(w, g, buf, buf, lr, lr=0.1, beta2=1.0))


def test_rules_build_one_op_per_update():
    assert _build(lambda w, g, buf, lr: rules.sgd_(w, g, lr=0.1)) == ["scaled_add_"]
    assert _build(lambda w, g, buf, lr: rules.sgd_(w, g, lr=lr)) == ["negate", "scaled_add_"]
    assert _build(lambda w, g, buf, lr: rules.sgd_(w, g, lr=0.1, momentum=0.9, momentum_buffer=buf)) == [
        "scaled_add_", "scaled_add_"]
    assert _build(lambda w, g, buf, lr: rules.rmsprop_(w, g, buf, lr=0.1)) == [
        "accumulate_moving_average_square_", "sqrt", "add", "div", "scaled_add_"]
