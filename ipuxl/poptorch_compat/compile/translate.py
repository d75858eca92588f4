"""From a ``torch.optim`` optimiser to per-parameter update plans for ``ipuxl.optim.rules``.

``translate(optimizer, names)`` reads every param group of a ``torch.optim.SGD``,
``Adam``, ``AdamW`` or ``RMSprop`` (or an ``ipuxl.optim`` PopTorch-style ``SGD``,
``Adam``, ``AdamW``, ``RMSprop``, ``LAMB`` with their extras) and returns one
:class:`ParamPlan` per parameter: the rule, its numeric hyperparameters and structural
flags by the rules' keyword names, the dtypes of its states and the loss scaling.
``initial_state`` / ``write_state`` move optimiser state between ``optimizer.state``
(torch's names and dtypes) and the rules' state tensors, so that "some eager steps,
then device steps, then eager steps" trains exactly like "all steps eager".

State names (rules <- torch): ``first_order`` <- ``exp_avg``, ``second_order`` <-
``exp_avg_sq``, ``max_second_order`` <- ``max_exp_avg_sq``, ``step`` <- ``step``
(float32 scalar), ``momentum_buffer``, ``square_avg``, ``grad_avg`` <- the same names.
SGD's ``step`` (the rules' first-step flag, needed with a non-zero dampening) has no
torch counterpart: it is 1 when torch holds a momentum buffer, else 0.

The compiler applies ``loss_scaling`` by using ``grad / loss_scaling`` as the gradient.

``AttributeChecks`` is PopTorch's check of the optimiser's attributes in
``setOptimizer``: attributes the first optimiser did not have are reported once each
(logger ``poptorch::python``), as warnings, or at debug level under
``Options.relaxOptimizerAttributesChecks()``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ipuxl.errors import ExecutorError, InvalidArgumentError
from ipuxl.ir.context import user_source_line
from ipuxl.optim.rules import StateSpec, state_specs
from ipuxl.poptorch_compat import optim as poptorch_optim
from ipuxl.poptorch_compat.optim_base import (
    GLOBAL_EXTRAS, INF, LAMB_MAX_WEIGHT_NORM, TORCH_STATE_NAMES, check_extras, explicit_state_dtypes, scalar_dtype,
    unwrapped_step,
)

__all__ = ["ParamPlan", "translate", "variable_hypers", "check_replacement", "initial_state", "write_state", "SUPPORTED",
           "AttributeChecks", "UPSTREAM_ATTRIBUTE", "upstream_type"]

_LOG = logging.getLogger("poptorch::python")

# supported optimiser class -> rule (the most derived match wins; see _rule_of)
SUPPORTED: dict[type, str] = {
    torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam", torch.optim.RMSprop: "rmsprop",
    poptorch_optim.SGD: "sgd", poptorch_optim.Adam: "adam", poptorch_optim.AdamW: "adam",
    poptorch_optim.RMSprop: "rmsprop", poptorch_optim.LAMB: "lamb",
}
_HYPERS = {"sgd": ("lr", "momentum", "dampening", "weight_decay"),
           "adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
           "lamb": ("lr", "beta1", "beta2", "eps", "weight_decay", "max_weight_norm"),
           "rmsprop": ("lr", "alpha", "eps", "weight_decay", "momentum")}
# rules' hyperparameter -> PopTorch's optimizer attribute (``variable_attrs`` names)
UPSTREAM_ATTRIBUTE = {"beta1": "betas", "beta2": "betas"}
# torch.optim optimisers (no ``variable_attrs``): PopTorch's constness of each attribute by its
# value: constant when it equals this (None: never constant; the string "always": always constant)
_CONSTANT_WHEN: dict[str, Any] = {"lr": None, "weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0, "eps": 1e-8,
                                  "alpha": "always", "beta1": "always", "beta2": "always",
                                  "max_weight_norm": LAMB_MAX_WEIGHT_NORM, "loss_scaling": 1.0}
_ANY_VALUE = 1.0  # stands for a variable hyperparameter where only zero-ness matters (structural_hypers)
_FLAGS = {"sgd": ("nesterov",), "adam": ("amsgrad", "bias_correction", "decoupled_weight_decay"),
          "lamb": ("bias_correction",), "rmsprop": ("centered",)}


@dataclass(frozen=True)
class ParamPlan:
    """How one parameter is updated: a rule of ``ipuxl.optim.rules`` and its options.

    Attributes:
        name: the parameter's name in the model.
        group: index of its param group in ``optimizer.param_groups``.
        rule: ``"sgd"``, ``"adam"`` (AdamW: ``flags["decoupled_weight_decay"]``),
            ``"lamb"`` or ``"rmsprop"``.
        hypers: numeric hyperparameters by the rule's keyword names (Python floats).
        flags: structural options by the rule's keyword names.
        state_dtypes: ``<state>_dtype`` options for ``rules.state_specs``, only for the
            states this plan uses whose dtype is not the parameter's.
        loss_scaling: the gradient the rule gets is ``grad / loss_scaling``.
        grad_accum_dtype: dtype for accumulating this parameter's gradient over
            micro-batches (PopTorch's ``accum_type``); ``None``: the parameter's dtype.
        max_grad_norm: before any update, the gradients of all the optimiser's
            parameters are scaled by ``max_grad_norm / max(norm, max_grad_norm)``
            (``norm``: their global L2 norm, after dividing out the loss scaling);
            ``inf``: no clipping. The same value in every plan of an optimiser.
        variable: the hyperparameters (keys of ``hypers``, and ``"loss_scaling"``)
            that are PopTorch's *variable* optimizer attributes: device variables of
            the program, which ``setOptimizer`` writes without recompiling. The
            others are constant: baked into the program (see :func:`variable_hypers`).
    """

    name: str
    group: int
    rule: str
    hypers: dict[str, float]
    flags: dict[str, bool]
    state_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    loss_scaling: float = 1.0
    grad_accum_dtype: torch.dtype | None = None
    max_grad_norm: float = INF
    variable: frozenset[str] = frozenset({"lr"})

    def structure_key(self) -> tuple:
        """Hashable; equal for two plans iff a program built for one runs the other by only
        changing hyperparameter values (streamed/variable hyperparameters).

        It holds the rule, the flags, the state dtypes, which hyperparameters are
        variable, which constant ones are exactly 0 (a 0 switches a part of the rule
        off), whether there is loss scaling at all, the gradient accumulation dtype and
        ``max_grad_norm``. It does not hold the parameter's name, shape or
        dtype: compare plans of the same parameter (or add those yourself).
        """
        return (self.rule,
                tuple(sorted(self.flags.items())),
                tuple(sorted((k, str(v)) for k, v in self.state_dtypes.items())),
                tuple(sorted(self.hypers)),
                tuple(sorted(self.variable)),
                tuple(sorted(k for k, v in self.hypers.items() if v == 0 and k not in self.variable)),
                "loss_scaling" in self.variable or self.loss_scaling != 1.0,
                str(self.grad_accum_dtype),
                self.max_grad_norm)

    def __hash__(self) -> int:  # consistent with the generated __eq__ (the dict fields are not hashable)
        return hash((self.name, self.group, self.structure_key(), tuple(sorted(self.hypers.items())),
                     self.loss_scaling))

    def structural_hypers(self) -> dict[str, float]:
        """``hypers`` as they decide the rule's structure: a variable hyperparameter may
        hold any value at run time, so its part of the rule is always built (a 0 held
        by a variable gives the same numbers as the part left out)."""
        return {k: (_ANY_VALUE if k in self.variable else v) for k, v in self.hypers.items()}

    def rule_kwargs(self) -> dict[str, Any]:
        """The rule's keyword options: ``RULES[plan.rule](w, g, **states, **plan.rule_kwargs())``."""
        return {**self.hypers, **self.flags}

    def state_specs(self, param: Any) -> dict[str, StateSpec]:
        """``rules.state_specs`` for ``param`` (anything with ``shape`` and ``dtype``) under this plan."""
        return state_specs(self.rule, param, **self.structural_hypers(), **self.flags, **self.state_dtypes)


def _error(what: str, fix: str) -> InvalidArgumentError:
    return InvalidArgumentError(what, where=user_source_line(), fix=fix)


def _supported_list() -> str:
    return ("torch.optim.SGD, torch.optim.Adam (decoupled_weight_decay too), torch.optim.AdamW, "
            "torch.optim.RMSprop, and ipuxl.optim's PopTorch-style SGD, Adam, AdamW, RMSprop, LAMB")


def _rule_of(optimizer: Any) -> str:
    cls = type(optimizer)
    for base in cls.__mro__:
        if base in SUPPORTED:
            if unwrapped_step(cls) is unwrapped_step(base):
                return SUPPORTED[base]
            raise _error(f"cannot translate a {cls.__module__}.{cls.__qualname__}: it subclasses "
                         f"{base.__module__}.{base.__qualname__} but overrides step(), so its update is unknown",
                         f"use one of the supported optimisers: {_supported_list()}")
    raise _error(f"cannot translate a {cls.__module__}.{cls.__qualname__} optimiser: not supported",
                 f"use one of the supported optimisers: {_supported_list()}")


def _hyper(group: dict[str, Any], gi: int, key: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise _error(f"param group {gi}: {key} is a tensor of shape {tuple(value.shape)}; only one-element "
                         "real tensors can be translated", f"set group['{key}'] to a Python float")
        value = value.detach().item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise _error(f"param group {gi}: {key} must be a number, got {value!r}", f"set group['{key}'] to a float")
    return float(value)


def _group_plan(optimizer: Any, rule: str, group: dict[str, Any], gi: int) -> tuple[dict, dict, float, Any]:
    """(hypers, flags, loss_scaling, grad_accum_dtype) of one param group."""
    for key in ("maximize", "differentiable"):
        if group.get(key, False):
            raise _error(f"param group {gi}: {key}=True is not supported by ipuxl's optimisers",
                         f"construct the optimiser with {key}=False")
    check_extras(f"param group {gi}", group)
    g: dict[str, Any] = {k: group[k] for k in ("lr", "momentum", "dampening", "weight_decay", "eps", "alpha")
                         if k in group}
    if "betas" in group:
        beta1, beta2 = group["betas"]
        g.update(beta1=beta1, beta2=beta2)
    if rule == "lamb":
        mwn = group.get("max_weight_norm", LAMB_MAX_WEIGHT_NORM)
        g["max_weight_norm"] = LAMB_MAX_WEIGHT_NORM if mwn is None else mwn
    missing = [k for k in _HYPERS[rule] if k not in g]
    if missing:
        raise _error(f"param group {gi}: missing hyperparameters {missing}", "add them to the param group")
    hypers = {k: _hyper(group, gi, k, g[k]) for k in _HYPERS[rule]}
    flags: dict[str, bool] = {}
    if rule == "sgd":
        flags["nesterov"] = bool(group.get("nesterov", False))
        if flags["nesterov"] and (hypers["momentum"] <= 0 or hypers["dampening"] != 0):
            raise _error(f"param group {gi}: Nesterov momentum requires a momentum and zero dampening "
                         f"(got momentum={hypers['momentum']}, dampening={hypers['dampening']})",
                         "set momentum > 0 and dampening=0, or nesterov=False")
    elif rule == "adam":
        flags["amsgrad"] = bool(group.get("amsgrad", False))
        flags["bias_correction"] = bool(group.get("bias_correction", True))
        flags["decoupled_weight_decay"] = bool(group.get("decoupled_weight_decay",
                                                         isinstance(optimizer, torch.optim.AdamW)))
    elif rule == "lamb":
        flags["bias_correction"] = bool(group.get("bias_correction", True))
    else:
        flags["centered"] = bool(group.get("centered", False))
        if group.get("use_tf_variant", False):
            flags["tf_variant"] = True
    return hypers, flags, float(group.get("loss_scaling", 1.0)), group.get("accum_type")


def translate(optimizer: torch.optim.Optimizer, names: Mapping[Any, str]) -> list[ParamPlan]:
    """One :class:`ParamPlan` per parameter of ``optimizer``, group by group in its order.

    Args:
        optimizer: a supported optimiser (see ``SUPPORTED``) built from the model's
            parameters. ``foreach``, ``fused`` and ``capturable`` are implementation
            choices and are ignored; ``maximize`` and ``differentiable`` are refused.
            One-element tensor hyperparameters are read as their exact values.
        names: each model parameter (the tensor itself: tensors hash by identity) to
            its name; a ``name -> tensor`` mapping is accepted too.

    Parameters with ``requires_grad=False`` get a plan like any other; the compiler
    skips parameters that get no gradient (as ``torch.optim`` skips ``grad is None``).
    """
    rule = _rule_of(optimizer)
    _check_global_extras(optimizer)
    by_id = {}
    for key, value in names.items():
        tensor, name = (value, key) if isinstance(key, str) else (key, value)
        by_id[id(tensor)] = name
    plans: list[ParamPlan] = []
    seen: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        hypers, flags, ls, accum = _group_plan(optimizer, rule, group, gi)
        variable = variable_hypers(optimizer, hypers, ls, decoupled=flags.get("decoupled_weight_decay", False))
        structural = {k: (_ANY_VALUE if k in variable else v) for k, v in hypers.items()}
        explicit = explicit_state_dtypes(group, rule)
        for pi, p in enumerate(group["params"]):
            if id(p) in seen:
                raise _error(f"parameter {pi} of param group {gi} (shape {tuple(p.shape)}) is also in param group "
                             f"{seen[id(p)]}", "put every parameter in exactly one param group")
            seen[id(p)] = gi
            if id(p) not in by_id:
                raise _error(f"parameter {pi} of param group {gi} (shape {tuple(p.shape)}, {p.dtype}) is not a "
                             "parameter of the model",
                             "build the optimiser from the model's parameters (model.parameters() or "
                             "model.named_parameters()), not from copies or other tensors")
            if not p.is_floating_point():
                raise _error(f"parameter '{by_id[id(p)]}' has dtype {p.dtype}; only real floating-point "
                             "parameters can be optimised", "use float16/float32 parameters")
            used = state_specs(rule, p, **structural, **flags)
            dtypes = {f"{s}_dtype": d for s, d in explicit.items() if s in used and d != p.dtype}
            plans.append(ParamPlan(by_id[id(p)], gi, rule, dict(hypers), dict(flags), dtypes, ls,
                                   None if accum in (None, p.dtype) else accum,
                                   float(group.get("max_grad_norm", INF)), variable))
    return plans


def variable_hypers(optimizer: Any, hypers: Mapping[str, float], loss_scaling: float, *,
                    decoupled: bool = False) -> frozenset[str]:
    """The hyperparameters of one param group (``hypers``, by the rules' names, and
    ``"loss_scaling"``) that are PopTorch's variable optimizer attributes.

    As upstream: an optimiser with ``variable_attrs`` (``ipuxl.optim``'s) says itself
    (``isConstant``; ``betas`` covers ``beta1`` and ``beta2``). For a ``torch.optim``
    optimiser the value decides: ``lr`` is always variable; ``alpha`` and ``betas`` are
    always constant; ``weight_decay`` (AdamW, and Adam with ``decoupled`` weight decay,
    which is AdamW: 0.01; else 0), ``momentum`` (0),
    ``dampening`` (0), ``eps`` (1e-8) and ``loss_scaling`` (1.0) are constant at
    those default values and variable at any other.
    """
    marks = getattr(optimizer, "variable_attrs", None)
    values = {**hypers, "loss_scaling": loss_scaling}
    if isinstance(marks, poptorch_optim.VariableAttributes):
        return frozenset(k for k in values if not marks.isConstant(UPSTREAM_ATTRIBUTE.get(k, k)))
    found = set()
    for key, value in values.items():
        constant_at = _CONSTANT_WHEN[key]
        if key == "weight_decay" and (decoupled or isinstance(optimizer, torch.optim.AdamW)):
            constant_at = 1e-2
        if constant_at is None or (constant_at != "always" and value != constant_at):
            found.add(key)
    return frozenset(found)


# rules' hyperparameter -> PopART's name for it in its optimizer-replacement errors
_POPART_LABEL = {"lr": "learning rates", "weight_decay": "weight decays", "momentum": "momentums",
                 "dampening": "dampenings", "eps": "eps", "alpha": "alphas", "beta1": "beta1s", "beta2": "beta2s",
                 "max_weight_norm": "max weight norms", "loss_scaling": "loss scaling"}


def check_replacement(compiled: list[ParamPlan], new: list[ParamPlan]) -> None:
    """Refuse, as PopTorch does, a ``setOptimizer`` optimiser that changes what the
    compiled program holds constant: a constant attribute's value, an attribute's
    constness (variable <-> constant), or ``max_grad_norm``. Parameters the two
    optimisers do not share, or whose rule or flags differ (another optimiser type),
    are not checked: ipuxl recompiles for those, as for other state dtypes.

    Raises:
        ExecutorError: PopART's message (``Problem with <attribute>. Values are constant
            but do not match.`` / ``Can not replace a constant value with a non constant
            value.``), with the param group, the values and the fix.
    """
    old_by_name = {plan.name: plan for plan in compiled}
    for plan in new:
        old = old_by_name.get(plan.name)
        if old is None or old.rule != plan.rule or old.flags != plan.flags:
            continue  # another optimiser type (Adam -> AdamW...) or flag: recompiled, not checked
        if old.max_grad_norm != plan.max_grad_norm:
            raise ExecutorError(f"setOptimizer: Clip norm settings do not match: the program was compiled with "
                                f"max_grad_norm={old.max_grad_norm}, got {plan.max_grad_norm}",
                                where=user_source_line(),
                                fix="keep max_grad_norm as compiled (it is a constant optimizer attribute), or "
                                    "destroy() the model and wrap it again with the new optimizer")
        _check_values(old, plan, {**old.hypers, "loss_scaling": old.loss_scaling},
                      {**plan.hypers, "loss_scaling": plan.loss_scaling})


def _check_values(old: ParamPlan, new: ParamPlan, before: dict[str, float], after: dict[str, float]) -> None:
    for key in sorted(before.keys() & after.keys()):
        was, now = key in old.variable, key in new.variable
        attr = UPSTREAM_ATTRIBUTE.get(key, key)
        where = "" if key == "loss_scaling" else f" (param group {new.group})"
        fix = (f"mark '{attr}' variable before wrapping the model (optimizer.variable_attrs.markAsVariable"
               f"('{attr}') before trainingModel, or pass it to an ipuxl.optim optimizer's constructor; a "
               f"torch.optim optimizer's '{attr}' is variable when not at its default value), then change it")
        if was != now:
            states = ("variable", "constant") if was else ("constant", "variable")
            raise ExecutorError(f"setOptimizer: Problem with {_POPART_LABEL[key]}{where}. Can not replace a constant "
                                f"value with a non constant value: '{attr}' was {states[0]} when the model was "
                                f"compiled, the new optimizer makes it {states[1]}", where=user_source_line(), fix=fix)
        if not was and before[key] != after[key]:
            raise ExecutorError(f"setOptimizer: Problem with {_POPART_LABEL[key]}{where}. Values are constant but "
                                f"do not match: the program was compiled with {key}={before[key]}, got {after[key]}",
                                where=user_source_line(), fix=fix)


def _check_global_extras(optimizer: torch.optim.Optimizer) -> None:
    """``loss_scaling`` and ``max_grad_norm`` are one value per optimiser (PopTorch's optimizer
    attributes): refuse param groups edited to differ."""
    for key in GLOBAL_EXTRAS:
        values = [group.get(key) for group in optimizer.param_groups]
        if any(v != values[0] for v in values):
            raise _error(f"{key} differs between param groups ({values}); it is one value for the whole optimiser",
                         f"set it on the optimiser (opt.{key} = ...), not in its param groups")


# -- state ------------------------------------------------------------------------------
def initial_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, plan: ParamPlan) -> dict[str, torch.Tensor]:
    """The optimiser's current state for ``param`` as the rules' state tensors.

    ``{}`` when ``optimizer`` holds no state for ``param`` (fresh: every state starts
    at zero). Otherwise every state of ``plan.state_specs(param)``, in its dtype
    (new tensors; a state torch does not hold yet is zeros, SGD's ``step`` is 1 when
    torch holds a momentum buffer, else 0, which gives torch's first-step rule).
    """
    torch_state = optimizer.state.get(param) if hasattr(optimizer.state, "get") else None
    if not torch_state:
        if plan.flags.get("tf_variant", False):  # TensorFlow's RMSprop starts square_avg at one
            spec = plan.state_specs(param)["square_avg"]
            return {"square_avg": torch.ones(spec.shape, dtype=spec.dtype)}
        return {}
    out = {}
    for name, spec in plan.state_specs(param).items():
        if plan.rule == "sgd" and name == "step":
            value = 1.0 if torch_state.get("momentum_buffer") is not None else 0.0
            out[name] = torch.tensor(value, dtype=spec.dtype)
            continue
        held = torch_state.get(TORCH_STATE_NAMES[name])
        if held is None:
            out[name] = torch.zeros(spec.shape, dtype=spec.dtype)
            continue
        tensor = torch.as_tensor(held).detach()
        if tuple(tensor.shape) != tuple(spec.shape):
            raise _error(f"optimizer state '{TORCH_STATE_NAMES[name]}' of parameter '{plan.name}' has shape "
                         f"{tuple(tensor.shape)}, expected {tuple(spec.shape)}",
                         "load a state dict that matches the model")
        out[name] = tensor.to(device="cpu", dtype=spec.dtype, copy=True)
    return out


def write_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, plan: ParamPlan,
                states: Mapping[str, Any], *, steps_taken: int | None = None) -> None:
    """Put the rules' ``states`` for ``param`` back into ``optimizer.state[param]``.

    Torch's names are used (``exp_avg``...) and the dtypes the optimiser's own step
    would keep: the plan's state dtype (the parameter's for ``torch.optim``), and
    ``step`` as torch's float32 scalar. Existing tensors are updated in place. SGD's
    ``step`` is dropped (torch.optim.SGD keeps none). Where the rule keeps no ``step``
    but torch does (RMSprop; Adam without bias correction), torch's ``step`` is
    advanced by ``steps_taken`` when given (created as ``steps_taken`` or 0 if missing);
    it does not enter those updates.
    """
    st = optimizer.state[param]
    for name, value in states.items():
        if name not in TORCH_STATE_NAMES:
            raise _error(f"write_state: unknown state '{name}' for parameter '{plan.name}'",
                         f"use the rules' state names: {sorted(TORCH_STATE_NAMES)}")
        if plan.rule == "sgd" and name == "step":
            continue
        value = torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value).detach()
        key = TORCH_STATE_NAMES[name]
        if name == "step":
            _set_step(st, float(value.reshape(()).item()))
            continue
        dtype = plan.state_dtypes.get(f"{name}_dtype", param.dtype)
        if tuple(value.shape) != tuple(param.shape):
            raise _error(f"write_state: state '{name}' for parameter '{plan.name}' has shape {tuple(value.shape)}, "
                         f"the parameter {tuple(param.shape)}", "pass states with the parameter's shape")
        old = st.get(key)
        if isinstance(old, torch.Tensor) and old.dtype == dtype and old.shape == value.shape:
            old.copy_(value)
        else:
            st[key] = value.to(device=param.device, dtype=dtype, copy=True)
    if "step" not in states and plan.rule != "sgd":
        old = st.get("step")
        base = float(old.item() if isinstance(old, torch.Tensor) else (old or 0))
        if steps_taken is not None or old is None:
            _set_step(st, base + (steps_taken or 0))


def _set_step(st: dict[str, Any], value: float) -> None:
    old = st.get("step")
    if isinstance(old, torch.Tensor) and old.dim() == 0:
        old.fill_(value)
    else:
        st["step"] = torch.tensor(value, dtype=scalar_dtype())


# attributes of torch's Optimizer base class, never reported (as upstream)
_BASE_ATTRIBUTES = frozenset({"defaults", "state", "param_groups", "variable_attrs", "_ipu_provider", "_ipu_state_dict"})


class AttributeChecks:
    """PopTorch's checks of the optimiser attributes given to ``setOptimizer``.

    The first optimiser's attributes are the expected ones: its own (``__dict__``
    without the base class's), the keys of ``defaults`` and of each param group
    (``params`` aside). A later optimiser's attributes outside them are reported once
    per message, ``"Ignoring unexpected <kind> in <TYPE> optimizer: [names]"``, as a
    warning, or at debug level when ``relax`` (``relaxOptimizerAttributesChecks``).
    """

    def __init__(self, relax: bool, optimizer: torch.optim.Optimizer | None = None):
        self._log: Callable[..., None] = _LOG.debug if relax else _LOG.warning
        self._group: list[str] = []
        self._optimizer: list[str] = []
        self._printed: set[str] = set()
        self._recording = True
        if optimizer is not None:
            self.check(optimizer)

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Record (first call) or check (later calls) ``optimizer``'s attributes."""
        kind = upstream_type(optimizer)
        self._compare(self._group, list(optimizer.defaults), "default group variable", kind)
        self._compare(self._optimizer, [k for k in vars(optimizer) if k not in _BASE_ATTRIBUTES],
                      "optimizer attribute", kind)
        for index, group in enumerate(optimizer.param_groups):
            self._compare(self._group, [k for k in group if k != "params"], f"group {index} attribute", kind)
        self._recording = False

    def _compare(self, expected: list[str], provided: list[str], what: str, kind: str) -> None:
        extra = [name for name in provided if name not in expected]
        if self._recording:
            expected += extra
        elif extra:
            message = f"Ignoring unexpected {what} in {kind} optimizer: {extra}"
            if message not in self._printed:
                self._printed.add(message)
                self._log(message)


def upstream_type(optimizer: Any) -> str:
    """PopTorch's name of the optimiser's type in its messages and logs (``SGD1`` with a
    combined accumulator, ``SGD2``, ``ADAM``, ``ADAMW``, ``ADAMW_NO_BIAS``, ``LAMB``,
    ``LAMB_NO_BIAS``, ``RMSPROP``, ``RMSPROP_CENTERED``); a torch ``Adam`` with decoupled
    weight decay is ``ADAMW``."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD1" if getattr(optimizer, "use_combined_accum", False) else "SGD2"
    if isinstance(optimizer, torch.optim.RMSprop):
        return "RMSPROP_CENTERED" if group.get("centered") else "RMSPROP"
    decoupled = isinstance(optimizer, torch.optim.Adam) and group.get("decoupled_weight_decay", False)
    if isinstance(optimizer, (torch.optim.AdamW, poptorch_optim.LAMB)) or decoupled:
        base = "LAMB" if isinstance(optimizer, poptorch_optim.LAMB) else "ADAMW"
        return base if getattr(optimizer, "bias_correction", True) else f"{base}_NO_BIAS"
    return "ADAM" if isinstance(optimizer, torch.optim.Adam) else type(optimizer).__name__.upper()
