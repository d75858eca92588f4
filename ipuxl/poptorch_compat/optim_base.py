"""What every PopTorch optimiser shares (``poptorch.optim.Optimizer`` and ``VariableAttributes``).

The optimisers themselves are in ``optim`` (``poptorch.optim``), which re-exports both
names. Here:

* ``check_extras``: the checks of PopTorch's extra arguments (``loss_scaling``, the
  accumulator dtypes, ``max_grad_norm``...), in a param group or the defaults;
* ``VariableAttributes`` and ``records_explicit_args``: the arguments passed explicitly
  to an optimiser's constructor are its variable attributes, as upstream;
* ``Optimizer``: the extras as optimizer attributes, recorded in ``defaults`` and every
  param group, and the eager ``step`` (torch.optim's, after clipping; parameters whose
  states have another dtype are updated by the subclass's eager rule);
* ``clip_factor``, ``clipped_grads``: PopART's gradient clipping by the global norm;
* the names and numbers ``compile.translate`` reads (``GLOBAL_EXTRAS``, ``TORCH_STATE_NAMES``,
  ``explicit_state_dtypes``, ``number``...).
"""
from __future__ import annotations

import functools
import inspect
import math
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

import torch

from ipuxl.errors import ExecutorError, InvalidArgumentError, InvalidValueError
from ipuxl.ir.context import user_source_line

__all__ = [
    "Optimizer", "VariableAttributes", "records_explicit_args", "check_extras", "explicit_state_dtypes", "number",
    "scalar_dtype", "unwrapped_step", "clip_factor", "clipped_grads", "INF", "LAMB_MAX_WEIGHT_NORM", "GLOBAL_EXTRAS",
    "TORCH_STATE_NAMES",
]

INF = float("inf")
_IPU_KEYS = ("ipu_state", "ipu_param")  # PopTorch's part of an optimiser state dict
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
#: PopTorch's optimiser extras whose ``None`` stands for a default (upstream's constructors
#: replace ``None`` by these: ``loss_scaling=None`` is no loss scaling, an accumulator
#: type ``None`` is float32)
NONE_MEANS: dict[str, Any] = {
    "loss_scaling": 1.0, "velocity_scaling": 1.0, "use_combined_accum": False, "bias_correction": True,
    "use_tf_variant": False, "accum_type": torch.float32, "velocity_accum_type": torch.float32,
    "first_order_momentum_accum_type": torch.float32, "second_order_momentum_accum_type": torch.float32,
}


def upstream_defaults(extras: dict[str, Any]) -> dict[str, Any]:
    """``extras`` with each ``None`` that upstream reads as a default replaced by it (``NONE_MEANS``)."""
    return {k: NONE_MEANS[k] if v is None and k in NONE_MEANS else v for k, v in extras.items()}


def _check_dtype(name: str, value: Any) -> None:
    if value is not None and value not in _ACCUM_DTYPES:
        raise _error(f"{name} must be torch.float16 or torch.float32 (or None: float32), got {value!r}",
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
    recompiling (``compile.translate.variable_hypers``). Mark attributes before the model is
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


def records_explicit_args(init: _Init) -> _Init:
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
        extras = upstream_defaults(extras)
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
        value = upstream_defaults({name: value})[name]
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
                     variable_attrs=self.__dict__.get("variable_attrs"),
                     _ipu_state_dict=self.__dict__.get("_ipu_state_dict"))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in getattr(self, "_ipuxl_extras", {}).items():
                group.setdefault(key, self.defaults.get(key, value))

    # -- PopTorch's ipu_state / ipu_param (``compile.ipu_state``) ---------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, and upstream's ``ipu_state`` / ``ipu_param``: the device's
        optimiser state and scalars by PopART's names while a compiled training model
        uses this optimiser (``runtime.ipu_optimizer_state``), else the ones loaded or
        read last, else None."""
        torch_part = super().state_dict()
        provider = self.__dict__.get("_ipu_provider")
        live = provider() if provider is not None else None
        ipu = live.read() if live is not None else None
        if ipu is None:
            ipu = self.__dict__.get("_ipu_state_dict") or {"ipu_state": None, "ipu_param": None}
        return {**ipu, **torch_part}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, and upstream's check that the dict is a PopTorch
        optimiser's (it has ``ipu_state`` and ``ipu_param``, None or not): a non-None
        ``ipu_state``/``ipu_param`` goes to the device before the next run.

        Raises:
            ExecutorError: an empty dict, or one without ``ipu_state``/``ipu_param``
                (a RuntimeError, with upstream's messages).
        """
        if not state_dict:
            raise ExecutorError("Cannot load optimizer state dictionary because it is empty.",
                                where=user_source_line(), fix="pass the dict a PopTorch optimizer's state_dict() gave")
        if "ipu_state" not in state_dict or "ipu_param" not in state_dict:
            raise ExecutorError("Only IPU optimizer states can be loaded onto the IPU.", where=user_source_line(),
                                fix="load a PopTorch optimizer's state_dict() (it has 'ipu_state' and 'ipu_param'); "
                                    "for a torch.optim one, add {'ipu_state': None, 'ipu_param': None} to it")
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in _IPU_KEYS})
        ipu = {key: state_dict[key] for key in _IPU_KEYS}
        has_state = ipu["ipu_state"] is not None and ipu["ipu_param"] is not None
        self.__dict__["_ipu_state_dict"] = ipu if has_state else None
        provider = self.__dict__.get("_ipu_provider")
        live = provider() if provider is not None else None
        if live is not None and has_state:
            live.loaded(ipu)

    def has_state(self) -> bool:
        """Whether an ``ipu_state`` was loaded or read (upstream's ``has_state``)."""
        return self.__dict__.get("_ipu_state_dict") is not None

    def attach_ipu_state(self, provider: Any) -> None:
        """A training model serves ``ipu_state``/``ipu_param`` from now on (held weakly)."""
        self.__dict__["_ipu_provider"] = weakref.ref(provider)

    def detach_ipu_state(self, last: dict[str, Any] | None) -> None:
        """No model serves them any more: keep ``last`` (the state read last)."""
        self.__dict__.pop("_ipu_provider", None)
        if last is not None:
            self.__dict__["_ipu_state_dict"] = last

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
    the hooks; ``compile.translate`` compares the steps of two classes)."""
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
