"""PopTorch's optimisers (``poptorch.optim``): ``torch.optim`` classes plus PopTorch's extra arguments.

``SGD``, ``Adam``, ``AdamW`` and ``RMSprop`` subclass the ``torch.optim`` class of
the same name and take the same arguments, followed by PopTorch 3.x's extras
(keyword only); ``LAMB`` is a ``torch.optim.Optimizer`` of its own. All of them
subclass :class:`Optimizer`. Every extra is an optimizer attribute, as upstream
(``opt.loss_scaling = 512.0``, ``opt.accum_type``), and is also recorded in
``defaults`` and in every param group, where ipuxl reads it; groups may differ in
the accumulator dtypes and ``bias_correction`` (an ipuxl extension) but not in
``loss_scaling`` and ``max_grad_norm``, which are one value per optimiser.
``opt.variable_attrs`` (:class:`VariableAttributes`) records which attributes are
variable, as upstream (the arguments passed explicitly).

With every extra at its default the eager ``.step()`` *is* ``torch.optim``'s, as
upstream's is. Extras:

* ``loss_scaling``: on the device the loss is multiplied by it before the backward
  pass and the gradients divided by it before the update, as PopTorch does (no
  numeric effect beyond rounding). The eager ``.step()`` ignores it, as upstream's.
* ``max_grad_norm`` (SGD, Adam, AdamW; default ``inf``): the gradients of all the
  optimiser's parameters are scaled by ``max_grad_norm / max(norm, max_grad_norm)``
  (``norm``: their global L2 norm) before the update, in the eager step too.
* ``accum_type``: dtype for accumulating gradients over micro-batches; recorded
  (ipuxl accumulates in the gradient's dtype).
* ``first_order_momentum_accum_type`` / ``second_order_momentum_accum_type``
  (``velocity_accum_type`` for SGD): dtypes of the optimiser states, float32 by
  default as upstream (float16 and float64 weights then keep float32 states).
  Adam/AdamW/LAMB: ``exp_avg`` / ``exp_avg_sq`` (and ``max_exp_avg_sq``); RMSprop:
  ``square_avg`` / ``grad_avg``; SGD: ``momentum_buffer``. ``None`` means the
  weight's dtype. A state of another dtype is stored rounded to it and read back
  into the weight's dtype for the arithmetic, as ``ipuxl.optim.rules`` does.
* ``bias_correction`` (AdamW, LAMB), ``max_weight_norm`` (LAMB: ``None`` means
  65500, PopTorch's float16 maximum; ``float("inf")`` turns the clipping off).
* ``velocity_scaling`` and ``use_combined_accum`` (SGD): recorded. Both of
  PopTorch's SGD variants are mathematically torch's SGD, and the combined variant
  divides the velocity scaling out again: no effect on a simulated device.
  Without ``use_combined_accum`` upstream warns that ``velocity_scaling`` is
  ignored; so does ipuxl (logger ``poptorch::python``).
* ``use_tf_variant`` (RMSprop): TensorFlow's RMSprop, as upstream: ``square_avg``
  starts at one, ``eps`` goes inside the square root and the learning rate into
  the momentum buffer.

Unlike PopTorch, ``amsgrad=True`` (Adam, AdamW) and ``nesterov=True`` (SGD) work.
A parameter whose states have another dtype, or an AdamW without bias correction, is
updated by an eager implementation of the same formula (``ipuxl.optim.rules``); the
other parameters go through ``torch.optim``'s own step.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

import torch

from ipuxl.errors import InvalidArgumentError, InvalidValueError
from ipuxl.ir.context import user_source_line

__all__ = ["Optimizer", "VariableAttributes", "SGD", "Adam", "AdamW", "RMSprop", "LAMB"]

INF = float("inf")
LAMB_MAX_WEIGHT_NORM = 65500.0  # PopTorch's default (float16 max) when max_weight_norm is None
_ACCUM_DTYPES = (torch.float16, torch.float32)
# extra option -> the rules' states whose dtype it sets, by rule
_STATE_DTYPE_OPTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "sgd": {"velocity_accum_type": ("momentum_buffer",)},
    "adam": {"first_order_momentum_accum_type": ("first_order",),
             "second_order_momentum_accum_type": ("second_order", "max_second_order")},
    "lamb": {"first_order_momentum_accum_type": ("first_order",),
             "second_order_momentum_accum_type": ("second_order",)},
    "rmsprop": {"first_order_momentum_accum_type": ("square_avg",),
                "second_order_momentum_accum_type": ("grad_avg",)},
}
# extras that are one value for the whole optimiser (PopTorch: optimizer attributes the device reads once)
GLOBAL_EXTRAS = ("loss_scaling", "max_grad_norm")
_LOG = logging.getLogger("poptorch::python")
# rules' state name -> torch.optim's state name
TORCH_STATE_NAMES = {"first_order": "exp_avg", "second_order": "exp_avg_sq", "max_second_order": "max_exp_avg_sq",
                     "step": "step", "momentum_buffer": "momentum_buffer", "square_avg": "square_avg",
                     "grad_avg": "grad_avg"}


def _error(what: str, fix: str) -> InvalidArgumentError:
    return InvalidArgumentError(what, where=user_source_line(), fix=fix)


def explicit_state_dtypes(group: dict[str, Any], rule: str) -> dict[str, torch.dtype]:
    """The rules' state dtypes a param group sets explicitly (its accum-type extras)."""
    out = {}
    for option, states in _STATE_DTYPE_OPTIONS[rule].items():
        dtype = group.get(option)
        if dtype is not None:
            for state in states:
                out[state] = dtype
    return out


def scalar_dtype() -> torch.dtype:
    """The dtype torch.optim gives ``state["step"]`` (float32; float64 under a float64 default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def number(value: Any) -> float:
    """A hyperparameter as a Python float (a one-element tensor read exactly with ``item()``)."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().item())
    return float(value)


# -- extras: validation and bookkeeping ----------------------------------------------
def _check_dtype(name: str, value: Any) -> None:
    if value is not None and value not in _ACCUM_DTYPES:
        raise _error(f"{name} must be torch.float16 or torch.float32 (or None: the weight's dtype), got {value!r}",
                     f"pass {name}=torch.float16 or torch.float32")


def check_extras(owner: str, group: dict[str, Any]) -> None:
    """Validate the PopTorch extras present in ``group`` (a param group or the defaults).

    Args:
        owner: who holds ``group``, to start messages with (``"param group 1"``).

    Raises:
        InvalidArgumentError: an extra has a value ipuxl does not support.
    """
    if "loss_scaling" in group:
        ls = group["loss_scaling"]
        if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not math.isfinite(ls) or ls <= 0:
            raise _error(f"{owner}: loss_scaling must be a finite number > 0, got {ls!r}",
                         "pass loss_scaling as a positive float, e.g. 128.0 (1.0: no loss scaling)")
    for key in ("accum_type", "velocity_accum_type", "first_order_momentum_accum_type",
                "second_order_momentum_accum_type"):
        if key in group:
            _check_dtype(f"{owner}: {key}", group[key])
    if "max_grad_norm" in group:
        mgn = group["max_grad_norm"]
        if isinstance(mgn, bool) or not isinstance(mgn, (int, float)) or not mgn > 0:
            raise _error(f"{owner}: max_grad_norm must be a number > 0 (float('inf'): no clipping), got {mgn!r}",
                         "pass a positive float, or leave it at its default (inf)")
    if "velocity_scaling" in group:
        vs = group["velocity_scaling"]
        if isinstance(vs, bool) or not isinstance(vs, (int, float)) or not math.isfinite(vs) or vs <= 0:
            raise _error(f"{owner}: velocity_scaling must be a finite number > 0, got {vs!r}",
                         "pass a positive float (1.0: no velocity scaling)")
    for key in ("bias_correction", "use_combined_accum", "use_tf_variant"):
        if key in group and not isinstance(group[key], bool):
            raise _error(f"{owner}: {key} must be a bool, got {group[key]!r}", f"pass {key}=True or False")
    if "max_weight_norm" in group:
        mwn = group["max_weight_norm"]
        if isinstance(mwn, bool) or not isinstance(mwn, (int, float)) or not mwn >= 0:
            raise _error(f"{owner}: max_weight_norm must be a number >= 0, got {mwn!r}",
                         "pass a positive float, float('inf') for no clipping, or None for PopTorch's 65500")


class VariableAttributes:
    """Which optimiser attributes are variable and which constant (PopTorch's class).

    Every PopTorch optimiser has one as ``opt.variable_attrs``: the arguments passed
    explicitly to the constructor are variable, the others constant. As in PopTorch,
    constant attributes are baked into the program and ``setOptimizer`` refuses to
    change them once compiled; variable ones are device variables it writes without
    recompiling (``translate.variable_hypers``). Mark attributes before the model is
    wrapped (``trainingModel`` reads the marks).

    Example:
        >>> opt = ipuxl.optim.SGD(model.parameters(), lr=0.01)
        >>> opt.variable_attrs.isConstant("momentum")
        True
    """

    def __init__(self, variable_attributes: list[str], allowed_attributes: list[str]) -> None:
        self._variable_attributes = list(variable_attributes)
        self._allowed_attributes = list(allowed_attributes)

    def isConstant(self, attr: str) -> bool:  # noqa: N802 - PopTorch's name
        """True unless ``attr`` is marked variable."""
        return attr not in self._variable_attributes

    def markAsConstant(self, attr: str) -> None:  # noqa: N802
        """Mark ``attr`` constant."""
        self._check(attr)
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr: str) -> None:  # noqa: N802
        """Mark ``attr`` variable."""
        self._check(attr)
        if attr not in self._variable_attributes:
            self._variable_attributes.append(attr)

    def _check(self, attr: str) -> None:
        if attr not in self._allowed_attributes:
            raise InvalidValueError(f"Unknown attribute {attr!r}, allowed values: {self._allowed_attributes}",
                                    where=user_source_line(), fix="use one of the allowed attribute names")

    def __repr__(self) -> str:
        return f"VariableAttributes(variable={self._variable_attributes})"


_Init = TypeVar("_Init", bound=Callable[..., None])


def _records_explicit_args(init: _Init) -> _Init:
    """Decorate an optimiser's ``__init__``: the arguments passed explicitly become
    ``variable_attrs``' variable attributes (as upstream)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        explicit = [k for k in signature.bind(self, *args, **kwargs).arguments if k not in ("self", "params")]
        init(self, *args, **kwargs)
        # a decorated subclass constructor finishes last: its caller's arguments win
        self.variable_attrs = VariableAttributes(explicit, list(self.defaults))

    return wrapper  # type: ignore[return-value]


if TYPE_CHECKING:  # the mixin always comes before a torch optimiser in the bases: type it as one
    _MixinBase = torch.optim.Optimizer
else:
    _MixinBase = object


class Optimizer(_MixinBase):
    """Base of PopTorch's optimisers (``poptorch.optim.Optimizer``): the PopTorch extras
    as optimizer attributes, recorded in ``defaults`` and in every param group."""

    _rule: str = ""
    _torch_base: type[torch.optim.Optimizer] | None = None

    def _set_extras(self, extras: dict[str, Any]) -> None:
        check_extras(type(self).__name__, extras)
        self._ipuxl_extras = dict(extras)

    def _finish_extras(self) -> None:
        self.defaults.update(self._ipuxl_extras)

    # -- the extras as attributes (PopTorch stores them on the optimizer) ------------------
    def __getattr__(self, name: str) -> Any:
        extras = self.__dict__.get("_ipuxl_extras")
        if extras is not None and name in extras:
            return extras[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        extras = self.__dict__.get("_ipuxl_extras")
        if extras is None or name not in extras or "param_groups" not in self.__dict__:
            super().__setattr__(name, value)
            return
        if name == "max_weight_norm" and value is None:
            value = LAMB_MAX_WEIGHT_NORM
        check_extras(type(self).__name__, {name: value})
        extras[name] = value
        self.defaults[name] = value
        for group in self.param_groups:
            group[name] = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        owner = f"{type(self).__name__} param group {len(getattr(self, 'param_groups', []))}"
        for key, value in getattr(self, "_ipuxl_extras", {}).items():
            if key == "max_weight_norm" and param_group.get(key, 0) is None:
                param_group[key] = LAMB_MAX_WEIGHT_NORM  # PopTorch: None means the float16 maximum
            if key in GLOBAL_EXTRAS and param_group.setdefault(key, value) != value:
                raise _error(f"{owner}: {key}={param_group[key]!r}, but {key} is one value for the whole optimiser "
                             f"({value!r}; PopTorch: an optimizer attribute)",
                             f"set it on the optimiser (opt.{key} = ...) instead of in a param group")
            param_group.setdefault(key, value)
        check_extras(owner, param_group)
        super().add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_ipuxl_extras=self.__dict__.get("_ipuxl_extras", {}),
                     variable_attrs=self.__dict__.get("variable_attrs"))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in getattr(self, "_ipuxl_extras", {}).items():
                group.setdefault(key, self.defaults.get(key, value))

    # -- eager step ---------------------------------------------------------------
    def _own_update(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        """True when ``p`` must be updated by the eager rule rather than torch.optim's step."""
        dtypes = explicit_state_dtypes(group, self._rule)
        return any(d != p.dtype for d in dtypes.values())

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient (clipped to ``max_grad_norm``;
        ``loss_scaling`` is not applied, as in PopTorch's eager step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with clipped_grads(self.param_groups, getattr(self, "_ipuxl_extras", {}).get("max_grad_norm", INF)):
            own = [(group, p, p.grad) for group in self.param_groups for p in group["params"]
                   if p.grad is not None and self._own_update(group, p)]
            for _, p, _ in own:
                p.grad = None
            try:
                if self._torch_base is not None:
                    unwrapped_step(self._torch_base)(self)
            finally:
                for _, p, grad in own:
                    p.grad = grad
            with torch.no_grad():
                for group, p, grad in own:
                    self._update(group, p, -grad if group.get("maximize", False) else grad)
        return loss


def unwrapped_step(cls: type[torch.optim.Optimizer]) -> Callable[..., Any]:
    """``cls.step`` without torch's profiling/hook wrapper (``Optimizer.step`` already runs
    the hooks; ``translate`` compares the steps of two classes)."""
    fn: Any = cls.step
    while getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """PopART's gradient clipping factor ``max_norm / max(norm, max_norm)`` (1 when ``norm <= max_norm``)."""
    return max_norm / torch.clamp(norm, min=max_norm)


@contextmanager
def clipped_grads(groups: Iterable[dict[str, Any]], max_norm: float) -> Iterator[None]:
    """Temporarily scale every ``p.grad`` of ``groups`` so that their global L2 norm is at
    most ``max_norm`` (the user's gradient tensors come back unchanged afterwards)."""
    params = [p for group in groups for p in group["params"] if p.grad is not None]
    if max_norm == INF or not params:
        yield
        return
    grads = [p.grad for p in params]
    with torch.no_grad():
        norm = torch.stack([g.detach().double().square().sum() for g in grads]).sum().sqrt()
        factor = clip_factor(norm, max_norm)
        for p, g in zip(params, grads):
            p.grad = (g * factor).to(g.dtype)
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


# -- eager rule helpers --------------------------------------------------------------
def _state(state: dict[str, Any], key: str, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``state[key]`` in ``dtype`` (created as zeros, or converted when its dtype differs)."""
    t = state.get(key)
    if t is None:
        t = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    elif t.dtype != dtype:
        t = t.to(dtype)
    state[key] = t
    return t


def _step(state: dict[str, Any]) -> torch.Tensor:
    step = state.get("step")
    if not isinstance(step, torch.Tensor):
        step = torch.tensor(float(step or 0), dtype=scalar_dtype())
        state["step"] = step
    step += 1
    return step


def _store(t: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t[...] = value`` rounded to ``t``'s dtype; returns the stored value read back in ``dtype``."""
    t.copy_(value)
    return t.to(dtype)


def _dtype_of(group: dict[str, Any], rule: str, state: str, p: torch.Tensor) -> torch.dtype:
    return explicit_state_dtypes(group, rule).get(state, p.dtype)


# -- SGD ------------------------------------------------------------------------------------
class SGD(Optimizer, torch.optim.SGD):
    """``torch.optim.SGD`` with PopTorch's extras (see the module docstring).

    Extras: ``loss_scaling=1.0``, ``velocity_scaling=1.0``, ``use_combined_accum=False``,
    ``accum_type=torch.float32``, ``velocity_accum_type=torch.float32``
    (``momentum_buffer``'s dtype), ``max_grad_norm=inf``.
    """

    _rule = "sgd"
    _torch_base = torch.optim.SGD

    @_records_explicit_args
    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float | torch.Tensor = 0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, differentiable: bool = False,
                 fused: bool | None = None, loss_scaling: float = 1.0, velocity_scaling: float = 1.0,
                 use_combined_accum: bool = False, accum_type: torch.dtype | None = torch.float32,
                 velocity_accum_type: torch.dtype | None = torch.float32,
                 max_grad_norm: float | None = INF) -> None:
        if velocity_scaling != 1.0 and not use_combined_accum:
            _LOG.warning("velocity_scaling value ignored when using the separate variant (use_combined_accum=False)")
        self._set_extras(dict(loss_scaling=loss_scaling, velocity_scaling=velocity_scaling,
                              use_combined_accum=use_combined_accum, accum_type=accum_type,
                              velocity_accum_type=velocity_accum_type,
                              max_grad_norm=INF if max_grad_norm is None else max_grad_norm))
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize,
                         foreach=foreach, differentiable=differentiable, fused=fused)
        self._finish_extras()

    def _own_update(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        return group["momentum"] != 0 and super()._own_update(group, p)

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        lr, momentum, dampening = number(group["lr"]), number(group["momentum"]), number(group["dampening"])
        wd = number(group["weight_decay"])
        dtype = torch.promote_types(p.dtype, grad.dtype)
        state = self.state[p]
        d_p = grad if wd == 0 else grad.add(p, alpha=wd)
        first = state.get("momentum_buffer") is None
        buf = _state(state, "momentum_buffer", p, _dtype_of(group, "sgd", "momentum_buffer", p))
        new = d_p.to(dtype, copy=True) if first else buf.to(dtype).mul_(momentum).add_(d_p, alpha=1 - dampening)
        b = _store(buf, new, dtype)
        d_p = d_p.add(b, alpha=momentum) if group["nesterov"] else b
        p.add_(d_p.to(p.dtype), alpha=-lr)


# -- Adam / AdamW ---------------------------------------------------------------------------
def _adam_update(self: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor,
                 bias_correction: bool) -> None:
    """torch.optim.Adam's single-tensor step, with states of their own dtypes and optional
    bias correction (the formula of ``rules.adam_``)."""
    lr, eps, wd = number(group["lr"]), number(group["eps"]), number(group["weight_decay"])
    beta1, beta2 = (number(b) for b in group["betas"])
    decoupled = group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW))
    state = self.state[p]
    step_t = _step(state)
    m_t = _state(state, "exp_avg", p, _dtype_of(group, "adam", "first_order", p))
    v_t = _state(state, "exp_avg_sq", p, _dtype_of(group, "adam", "second_order", p))
    if wd != 0:
        if decoupled:
            p.mul_(1 - lr * wd)
        else:
            grad = grad.add(p, alpha=wd)
    dtype = torch.promote_types(p.dtype, grad.dtype)
    m = _store(m_t, m_t.to(dtype).lerp(grad.to(dtype), 1 - beta1), dtype)
    v = _store(v_t, v_t.to(dtype).mul(beta2).addcmul_(grad, grad, value=1 - beta2), dtype)
    if group["amsgrad"]:
        mx_t = _state(state, "max_exp_avg_sq", p, _dtype_of(group, "adam", "max_second_order", p))
        v = _store(mx_t, torch.maximum(mx_t.to(dtype), v), dtype)
    step = float(step_t.item())
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    compute = torch.promote_types(dtype, torch.float32)
    denom = (v.to(compute).sqrt() / math.sqrt(bc2)).add_(eps)
    p.add_((m.to(compute) / denom).to(p.dtype), alpha=-lr / bc1)


class Adam(Optimizer, torch.optim.Adam):
    """``torch.optim.Adam`` with PopTorch's extras (see the module docstring).

    Extras: ``loss_scaling=1.0``, ``accum_type=torch.float32``,
    ``first_order_momentum_accum_type=torch.float32`` (``exp_avg``),
    ``second_order_momentum_accum_type=torch.float32`` (``exp_avg_sq``, ``max_exp_avg_sq``),
    ``max_grad_norm=inf``. Unlike PopTorch, ``amsgrad=True`` is supported.
    """

    _rule = "adam"
    _torch_base = torch.optim.Adam

    @_records_explicit_args
    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False, loss_scaling: float = 1.0,
                 accum_type: torch.dtype | None = torch.float32,
                 first_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 second_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 max_grad_norm: float | None = INF) -> None:
        self._set_extras(dict(loss_scaling=loss_scaling, accum_type=accum_type,
                              first_order_momentum_accum_type=first_order_momentum_accum_type,
                              second_order_momentum_accum_type=second_order_momentum_accum_type,
                              max_grad_norm=INF if max_grad_norm is None else max_grad_norm))
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=decoupled_weight_decay)
        self._finish_extras()

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        _adam_update(self, group, p, grad, True)


class AdamW(Optimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` with PopTorch's extras (see the module docstring).

    Extras: ``loss_scaling=1.0``, ``bias_correction=True``, ``accum_type=torch.float32``,
    ``first_order_momentum_accum_type=torch.float32``,
    ``second_order_momentum_accum_type=torch.float32``, ``max_grad_norm=inf``.
    """

    _rule = "adam"
    _torch_base = torch.optim.AdamW

    @_records_explicit_args
    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, loss_scaling: float = 1.0, bias_correction: bool = True,
                 accum_type: torch.dtype | None = torch.float32,
                 first_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 second_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 max_grad_norm: float | None = INF) -> None:
        self._set_extras(dict(loss_scaling=loss_scaling, bias_correction=bias_correction, accum_type=accum_type,
                              first_order_momentum_accum_type=first_order_momentum_accum_type,
                              second_order_momentum_accum_type=second_order_momentum_accum_type,
                              max_grad_norm=INF if max_grad_norm is None else max_grad_norm))
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused)
        self._finish_extras()

    def _own_update(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        return not group.get("bias_correction", True) or super()._own_update(group, p)

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        _adam_update(self, group, p, grad, group.get("bias_correction", True))


# -- RMSprop ------------------------------------------------------------------------------
class RMSprop(Optimizer, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` with PopTorch's extras (see the module docstring).

    Extras: ``loss_scaling=1.0``, ``accum_type=torch.float32``,
    ``first_order_momentum_accum_type=torch.float32`` (``square_avg``),
    ``second_order_momentum_accum_type=torch.float32`` (``grad_avg``),
    ``use_tf_variant=False`` (True: TensorFlow's variant, see the module docstring).
    """

    _rule = "rmsprop"
    _torch_base = torch.optim.RMSprop

    @_records_explicit_args
    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-2, alpha: float = 0.99,
                 eps: float = 1e-8, weight_decay: float = 0, momentum: float = 0, centered: bool = False,
                 capturable: bool = False, foreach: bool | None = None, maximize: bool = False,
                 differentiable: bool = False, *, loss_scaling: float = 1.0,
                 accum_type: torch.dtype | None = torch.float32,
                 first_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 second_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 use_tf_variant: bool = False) -> None:
        self._set_extras(dict(loss_scaling=loss_scaling, accum_type=accum_type,
                              first_order_momentum_accum_type=first_order_momentum_accum_type,
                              second_order_momentum_accum_type=second_order_momentum_accum_type,
                              use_tf_variant=use_tf_variant))
        super().__init__(params, lr, alpha, eps, weight_decay, momentum, centered, capturable=capturable,
                         foreach=foreach, maximize=maximize, differentiable=differentiable)
        self._finish_extras()

    def _own_update(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        if group.get("use_tf_variant", False):
            return True
        dtypes = explicit_state_dtypes(group, "rmsprop")
        if not group["centered"]:
            dtypes.pop("grad_avg", None)
        return any(d != p.dtype for d in dtypes.values())

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        lr, alpha, eps = number(group["lr"]), number(group["alpha"]), number(group["eps"])
        wd, momentum = number(group["weight_decay"]), number(group["momentum"])
        tf = group.get("use_tf_variant", False)
        state = self.state[p]
        _step(state)
        fresh = "square_avg" not in state
        s_t = _state(state, "square_avg", p, _dtype_of(group, "rmsprop", "square_avg", p))
        if tf and fresh:
            s_t.fill_(1.0)  # TensorFlow starts the average of squares at one
        if wd != 0:
            grad = grad.add(p, alpha=wd)
        dtype = torch.promote_types(p.dtype, grad.dtype)
        s = _store(s_t, s_t.to(dtype).mul(alpha).addcmul_(grad, grad, value=1 - alpha), dtype)
        if group["centered"]:
            a_t = _state(state, "grad_avg", p, _dtype_of(group, "rmsprop", "grad_avg", p))
            a = _store(a_t, a_t.to(dtype).lerp(grad.to(dtype), 1 - alpha), dtype)
            s = s.addcmul(a, a, value=-1)
        avg = s.add(eps).sqrt_() if tf else s.sqrt().add_(eps)
        if momentum > 0:
            b_t = _state(state, "momentum_buffer", p, p.dtype)
            b = _store(b_t, b_t.to(dtype).mul(momentum).addcdiv_(grad, avg, value=lr if tf else 1.0), dtype)
            p.add_(b.to(p.dtype), alpha=-1.0 if tf else -lr)
        else:
            p.add_((grad / avg).to(p.dtype), alpha=-lr)


# -- LAMB --------------------------------------------------------------------------------------
class LAMB(Optimizer, torch.optim.Optimizer):
    """Layer-wise Adaptive Moments (LAMB, You et al. 2019), PopTorch's ``poptorch.optim.LAMB``.

    For each parameter, with ``g = p.grad / loss_scaling`` and ``t`` the step after
    incrementing it (the formula of ``ipuxl.optim.rules.lamb_``)::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        m_hat = m / (1 - beta1**t), v_hat = v / (1 - beta2**t)   (bias_correction; else m, v)
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
        r = min(||w||, max_weight_norm) / ||u||      (r = 1 when ||w|| or ||u|| is 0)
        w -= lr * r * u

    Norms are over the whole parameter, from float32 sums of squares; ``u`` is computed
    in float32 (float64 for float64 parameters). States are torch-named: ``step``
    (a float32 scalar tensor, as torch.optim.Adam's), ``exp_avg``, ``exp_avg_sq``.

    Args (PopTorch's, defaults included): ``lr=1e-3``, ``betas=(0.9, 0.999)``,
    ``eps=1e-8``, ``weight_decay=1e-2``, ``bias_correction=True``, ``loss_scaling=1.0``,
    ``max_weight_norm=None`` (65500.0; ``inf`` for none), ``accum_type=torch.float32``,
    ``first_order_momentum_accum_type=torch.float32``,
    ``second_order_momentum_accum_type=torch.float32``.
    """

    _rule = "lamb"

    @_records_explicit_args
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, bias_correction: bool = True,
                 loss_scaling: float = 1.0, max_weight_norm: float | None = None,
                 accum_type: torch.dtype | None = torch.float32,
                 first_order_momentum_accum_type: torch.dtype | None = torch.float32,
                 second_order_momentum_accum_type: torch.dtype | None = torch.float32) -> None:
        lr_, eps_, wd_ = number(lr), number(eps), number(weight_decay)
        if not lr_ >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps_ >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= number(beta) < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not wd_ >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self._set_extras(dict(bias_correction=bias_correction, loss_scaling=loss_scaling,
                              max_weight_norm=LAMB_MAX_WEIGHT_NORM if max_weight_norm is None else max_weight_norm,
                              accum_type=accum_type, first_order_momentum_accum_type=first_order_momentum_accum_type,
                              second_order_momentum_accum_type=second_order_momentum_accum_type))
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._finish_extras()

    def _own_update(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        return True

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        lr, eps, wd = number(group["lr"]), number(group["eps"]), number(group["weight_decay"])
        beta1, beta2 = (number(b) for b in group["betas"])
        mwn = group.get("max_weight_norm", LAMB_MAX_WEIGHT_NORM)
        mwn = LAMB_MAX_WEIGHT_NORM if mwn is None else float(mwn)
        state = self.state[p]
        step_t = _step(state)
        m_t = _state(state, "exp_avg", p, _dtype_of(group, "lamb", "first_order", p))
        v_t = _state(state, "exp_avg_sq", p, _dtype_of(group, "lamb", "second_order", p))
        dtype = torch.promote_types(p.dtype, grad.dtype)
        m = _store(m_t, m_t.to(dtype).mul(beta1).add_(grad, alpha=1 - beta1), dtype)
        v = _store(v_t, v_t.to(dtype).mul(beta2).addcmul_(grad, grad, value=1 - beta2), dtype)
        step = float(step_t.item())
        bc1 = 1 - beta1 ** step if group.get("bias_correction", True) else 1.0
        bc2 = 1 - beta2 ** step if group.get("bias_correction", True) else 1.0
        compute = torch.promote_types(dtype, torch.float32)
        u = (m.to(compute) / bc1) / (v.to(compute).sqrt() / math.sqrt(bc2) + eps)
        if wd != 0:
            u = u.add_(p.to(compute), alpha=wd)
        u = u.to(p.dtype)
        r1 = p.float().square().sum()
        r2 = u.float().square().sum()
        if r1 == 0 or r2 == 0:
            ratio = torch.ones(())
        else:
            ratio = torch.clamp(r1.sqrt(), max=mwn) / r2.sqrt()
        p.sub_((lr * ratio * u).to(p.dtype))
