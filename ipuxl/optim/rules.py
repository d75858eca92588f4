"""Update rules shared by ipuxl's graph optimisers (SGD, Adam/AdamW, LAMB, RMSprop).

Each rule is a plain graph-building function: called inside a graph (``ipuxl.gcg()``)
it adds the ops that update one weight and its optimiser state *in place*
(``ops.var_updates.*``, ``ops.scaled_add_``) and returns nothing. The rules follow
``torch.optim`` exactly (first step, where weight decay and ``eps`` enter), so a
program built from them trains like eager PyTorch up to float32 rounding.

Conventions:

* Hyperparameters (``lr``, ``momentum``, betas, ``eps``, ``weight_decay``...) are
  Python numbers, baked into the program, or scalar float tensors of the current
  graph (host loads, variables, graph inputs), changeable between runs without
  rebuilding. Structural options (``nesterov``, ``amsgrad``, ``centered``,
  ``bias_correction``, ``decoupled_weight_decay``) are Python bools. A hyperparameter
  that is the number 0 switches its part of the rule off (as in ``torch.optim``);
  a tensor always builds it (a tensor holding 0 then gives the same numbers).
* State tensors are passed in (variables, or by-reference inputs of an optimiser
  subgraph): the rules never create variables. Every state starts at zero;
  :func:`state_specs` says which states a rule needs and their shapes and dtypes.
  ``step`` is a float32 scalar counting the updates done, incremented in place.
* A rule's ops are built ``in_sequence`` (its reads of a state come before the state's
  in-place update). AdamW's decoupled decay scales the weight before anything reads
  the gradient, so a caller that reads the weight elsewhere orders the rule after
  those reads (``in_sequence``, as ``trainingModel`` and the optimiser modules do).
* Arithmetic runs in the dtype torch would use, ``promote(weight, grad)``; a state
  of another dtype (e.g. a float16 ``first_order`` for float32 weights) is read
  into that dtype and rounded to its own dtype when stored.
"""
from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import torch.fx as fx

from ipuxl.dtypes import DTypeLike, dtype_name, from_any, to_numpy_dtype
from ipuxl.errors import InvalidArgumentError
from ipuxl.ir.aliases import storage_owner, writes
from ipuxl.ir.context import in_sequence, user_source_line
from ipuxl.ir.graph_builder import constant
from ipuxl.ir.tensor import Tensor
from ipuxl.ops import var_updates
from ipuxl.ops.elementwise import add_, equal, maximum, scaled_add, scaled_add_, sqrt, where
from ipuxl.ops.reduce import lamb_square
from ipuxl.ops.shape import cast

__all__ = ["sgd_", "adam_", "lamb_", "rmsprop_", "clip_grad_norm", "state_specs", "StateSpec", "RULES"]

Hyper = float | Tensor


# -- rules -------------------------------------------------------------------------
@in_sequence()
def sgd_(weight: Tensor, grad: Tensor, *, lr: Hyper, momentum: Hyper = 0.0, dampening: Hyper = 0.0,
         nesterov: bool = False, weight_decay: Hyper = 0.0, momentum_buffer: Tensor | None = None,
         step: Tensor | None = None) -> None:
    """``torch.optim.SGD`` for one weight.

    With ``g = grad + weight_decay * w``::

        b = g                                    first step (torch creates the buffer)
        b = momentum * b + (1 - dampening) * g   later steps
        d = g + momentum * b  (nesterov)   else  d = b      (d = g without momentum)
        w -= lr * d

    The first step is told apart by ``step == 0`` (``step`` is then incremented):
    the buffer update becomes ``b = 0 * b + 1 * g`` (``ops.where`` on the two scalar
    coefficients), exactly ``g`` whatever finite value the buffer holds. Without
    ``step`` the buffer must start at zero and ``dampening`` must be the number 0,
    so that ``momentum * 0 + 1 * g`` is already exactly ``g``.

    Args:
        momentum_buffer: needed when ``momentum`` is not the number 0.
        step: float32 scalar update count; needed for a non-zero ``dampening``.
    """
    _check_hypers("sgd_", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    use_momentum = not _is_zero(momentum)
    if nesterov and (not use_momentum or _is_nonzero_number(dampening)):
        raise _error("sgd_: Nesterov momentum requires a momentum and zero dampening (as torch.optim.SGD)",
                     "pass momentum > 0 and dampening=0, or nesterov=False")
    if use_momentum:
        _require("sgd_", momentum_buffer=momentum_buffer)
        if step is None and not _is_zero(dampening):
            raise _error("sgd_: a non-zero dampening needs the `step` counter to tell the first step apart "
                         "(torch does not dampen the first step)",
                         "pass step= (a float32 scalar variable starting at 0; see state_specs)")
    _check_states("sgd_", weight, momentum_buffer=momentum_buffer)
    dtype = _compute_dtype(weight, grad)
    d_p = grad if _is_zero(weight_decay) else scaled_add(grad, weight, 1.0, weight_decay)
    if use_momentum:
        assert momentum_buffer is not None  # _require checked it
        a: Hyper
        b: Hyper
        if step is not None:
            first = equal(step, 0.0)
            scalar = torch.promote_types(dtype, torch.float32)
            a = where(first, 0.0, _scalar(momentum, scalar))
            b = where(first, 1.0, _scalar(1.0 - dampening, scalar))
        else:
            a, b = momentum, 1.0
        buf = _as(_axpby_(momentum_buffer, d_p, a, b, dtype), dtype)
        d_p = scaled_add(d_p, buf, 1.0, momentum) if nesterov else buf
    if step is not None:
        add_(step, 1.0)
    scaled_add_(weight, d_p, b=_negated(lr))


@in_sequence()
def adam_(weight: Tensor, grad: Tensor, first_order: Tensor, second_order: Tensor, step: Tensor | None = None,
          *, lr: Hyper, beta1: Hyper = 0.9, beta2: Hyper = 0.999, eps: Hyper = 1e-8, weight_decay: Hyper = 0.0,
          decoupled_weight_decay: bool = False, bias_correction: bool = True, amsgrad: bool = False,
          max_second_order: Tensor | None = None) -> None:
    """``torch.optim.Adam`` (``decoupled_weight_decay=True``: ``torch.optim.AdamW``) for one weight.

    With ``t`` the step after incrementing it::

        w *= 1 - lr * weight_decay       (decoupled: AdamW)   else  g = grad + weight_decay * w
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        v' = max(v', v) and use v' for v      (amsgrad; v' is max_second_order)
        m_hat = m / (1 - beta1**t), v_hat = v / (1 - beta2**t)   (bias_correction; else m, v)
        w -= lr * m_hat / (sqrt(v_hat) + eps)

    ``eps`` is added after the square root of the *corrected* ``v``, as torch does.
    The update term is one ``ops.var_updates.adam_updater`` op, computed in float32
    even for float16 states (the bias corrections ``1 - beta**t`` in float32 too,
    where torch uses Python floats: a relative difference of about 1e-7/(1 - beta)).

    Args:
        first_order, second_order: ``m`` and ``v`` (any float dtype).
        step: float32 scalar update count, incremented in place; needed for
            ``bias_correction`` (optional otherwise).
        max_second_order: ``amsgrad``'s running maximum of ``v``.
    """
    _check_hypers("adam_", lr=lr, eps=eps, weight_decay=weight_decay, beta1=beta1, beta2=beta2)
    if bias_correction:
        _require("adam_", step=step)
    if amsgrad:
        _require("adam_", max_second_order=max_second_order)
    _check_states("adam_", weight, first_order=first_order, second_order=second_order,
                  max_second_order=max_second_order if amsgrad else None)
    dtype = _compute_dtype(weight, grad)
    g = grad
    if not _is_zero(weight_decay):
        if decoupled_weight_decay:
            weight = var_updates.accumulator_scale_(weight, 1.0 - lr * weight_decay)
        else:
            g = scaled_add(grad, weight, 1.0, weight_decay)
    m = _moving_average_(first_order, g, beta1, dtype)
    v = _moving_average_square_(second_order, g, beta2, dtype)
    if amsgrad:
        assert max_second_order is not None  # _require checked it
        v = _store(max_second_order, maximum(_as(max_second_order, dtype), _as(v, dtype)))
    if bias_correction:
        update = var_updates.adam_updater(_as(m, dtype), v, weight, step, None, beta1, beta2, eps)
    else:
        update = var_updates.adam_updater(_as(m, dtype), v, weight, None, None, None, None, eps)
        if step is not None:
            add_(step, 1.0)
    scaled_add_(weight, update, b=_negated(lr))


@in_sequence()
def lamb_(weight: Tensor, grad: Tensor, first_order: Tensor, second_order: Tensor, step: Tensor | None = None,
          *, lr: Hyper, beta1: Hyper = 0.9, beta2: Hyper = 0.999, eps: Hyper = 1e-6, weight_decay: Hyper = 0.0,
          bias_correction: bool = True, max_weight_norm: Hyper | None = None) -> None:
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") for one weight.

    With ``t`` the step after incrementing it::

        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad**2
        m_hat = m / (1 - beta1**t), v_hat = v / (1 - beta2**t)   (bias_correction; else m, v)
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
        r = min(||w||, max_weight_norm) / ||u||      (r = 1 when ||w|| or ||u|| is 0)
        w -= lr * r * u

    Norms are over the whole weight, from float32 sums of squares
    (``ops.lamb_square``); the step is ``ops.var_updates.adam_var_update``.
    """
    _check_hypers("lamb_", lr=lr, eps=eps, weight_decay=weight_decay, beta1=beta1, beta2=beta2)
    if max_weight_norm is not None:
        _check_hypers("lamb_", max_weight_norm=max_weight_norm)
    if bias_correction:
        _require("lamb_", step=step)
    _check_states("lamb_", weight, first_order=first_order, second_order=second_order)
    dtype = _compute_dtype(weight, grad)
    m = _moving_average_(first_order, grad, beta1, dtype)
    v = _moving_average_square_(second_order, grad, beta2, dtype)
    if bias_correction:
        update = var_updates.lamb_updater(m, v, weight, step, weight_decay, beta1, beta2, eps)
    else:
        update = var_updates.lamb_updater(m, v, weight, None, weight_decay, None, None, eps)
        if step is not None:
            add_(step, 1.0)
    var_updates.adam_var_update(weight, update, lamb_square(weight), lamb_square(update),
                                learning_rate=lr, max_weight_norm=max_weight_norm)


@in_sequence()
def rmsprop_(weight: Tensor, grad: Tensor, square_avg: Tensor, *, lr: Hyper, alpha: Hyper = 0.99,
             eps: Hyper = 1e-8, weight_decay: Hyper = 0.0, momentum: Hyper = 0.0, centered: bool = False,
             tf_variant: bool = False, momentum_buffer: Tensor | None = None,
             grad_avg: Tensor | None = None) -> None:
    """``torch.optim.RMSprop`` for one weight.

    With ``g = grad + weight_decay * w``::

        s = alpha * s + (1 - alpha) * g**2                    (s: square_avg)
        a = alpha * a + (1 - alpha) * g                       (centered; a: grad_avg)
        denom = sqrt(s - a**2) + eps   (centered)   else  denom = sqrt(s) + eps
        b = momentum * b + g / denom;  w -= lr * b            (momentum; b: momentum_buffer)
        w -= lr * g / denom                                   (no momentum)

    All states start at zero (torch's too), so no step counter is needed.

    ``tf_variant`` (TensorFlow's RMSprop, PopTorch's ``use_tf_variant``): ``s``
    starts at one (the caller initialises ``square_avg`` so), ``eps`` goes inside the
    square root (``denom = sqrt(s - a**2 + eps)``) and the learning rate enters the
    momentum buffer (``b = momentum * b + lr * g / denom;  w -= b``).
    """
    _check_hypers("rmsprop_", lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum)
    use_momentum = not _is_zero(momentum)
    if use_momentum:
        _require("rmsprop_", momentum_buffer=momentum_buffer)
    if centered:
        _require("rmsprop_", grad_avg=grad_avg)
    _check_states("rmsprop_", weight, square_avg=square_avg, momentum_buffer=momentum_buffer if use_momentum else None,
                  grad_avg=grad_avg if centered else None)
    dtype = _compute_dtype(weight, grad)
    g = grad if _is_zero(weight_decay) else scaled_add(grad, weight, 1.0, weight_decay)
    s = _as(_moving_average_square_(square_avg, g, alpha, dtype), dtype)
    if centered:
        assert grad_avg is not None  # _require checked it
        a = _as(_moving_average_(grad_avg, g, alpha, dtype), dtype)
        s = s - a * a
    direction = g / sqrt(s + eps) if tf_variant else g / (sqrt(s) + eps)
    if use_momentum:
        assert momentum_buffer is not None  # _require checked it
        if tf_variant:
            step = _as(_axpby_(momentum_buffer, direction, momentum, lr, dtype), dtype)
            scaled_add_(weight, step, b=-1.0)
            return
        direction = _as(_axpby_(momentum_buffer, direction, momentum, 1.0, dtype), dtype)
    scaled_add_(weight, direction, b=_negated(lr))


def clip_grad_norm(grads: list[Tensor], max_norm: float) -> list[Tensor]:
    """Gradients clipped by their global L2 norm, as PopART's ``max_grad_norm`` (PopTorch's
    optimisers): every gradient scaled by ``max_norm / max(norm, max_norm)``, where
    ``norm`` is the L2 norm of all of them together (float32 sums of squares).
    ``max_norm=inf`` returns ``grads`` unchanged (no ops)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise _error(f"clip_grad_norm: max_norm must be a number > 0, got {max_norm!r}",
                     "pass a positive float (float('inf'): no clipping)")
    if max_norm == float("inf") or not grads:
        return list(grads)
    total = lamb_square(grads[0])
    for g in grads[1:]:
        total = total + lamb_square(g)
    factor = max_norm / maximum(sqrt(total), constant(np.asarray(max_norm, np.float32), torch.float32))
    return [g * _as(factor, g.dtype) for g in grads]


RULES: dict[str, Callable[..., None]] = {"sgd": sgd_, "adam": adam_, "adamw": adam_, "lamb": lamb_,
                                         "rmsprop": rmsprop_}


# -- state specs -------------------------------------------------------------------------
class StateSpec(NamedTuple):
    """Shape and dtype of one optimiser state tensor (unpacks as ``shape, dtype``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def zeros(self) -> np.ndarray:
        """The state's initial value (every state starts at zero), for ``ipuxl.variable``."""
        return np.zeros(self.shape, to_numpy_dtype(self.dtype))


_STATES = {
    "sgd": ("momentum_buffer", "step"),
    "adam": ("first_order", "second_order", "step", "max_second_order"),
    "lamb": ("first_order", "second_order", "step"),
    "rmsprop": ("square_avg", "momentum_buffer", "grad_avg"),
}


def state_specs(rule: str | Callable[..., None], weight: Any, **options: Any) -> dict[str, StateSpec]:
    """The state tensors ``rule`` needs for ``weight`` with ``options``, by keyword name.

    Create each as a zero-initialised variable (``ipuxl.variable(spec.zeros(),
    spec.dtype)``) and pass them to the rule by these names (``rule(weight, grad,
    **states, **options)``).

    Args:
        rule: ``"sgd"``, ``"adam"``, ``"adamw"``, ``"lamb"``, ``"rmsprop"`` (a trailing
            ``_`` is allowed) or the rule function itself.
        weight: anything with ``shape`` and ``dtype`` (an ipuxl Tensor, TensorSpec,
            numpy array).
        options: the rule's keyword options (hyperparameters that decide which states
            exist: ``momentum``, ``dampening``, ``bias_correction``, ``amsgrad``,
            ``centered``; the others are accepted and ignored), and ``<state>_dtype``
            for any state (default: the weight's dtype; ``step``: float32).

    Example:
        >>> state_specs("adam", w, amsgrad=True, first_order_dtype=ipuxl.float16)
        {'first_order': StateSpec(shape=(4, 3), dtype=torch.float16), 'second_order': ...,
         'step': StateSpec(shape=(), dtype=torch.float32), 'max_second_order': ...}
    """
    name, fn = _rule(rule)
    states = _STATES[name]
    allowed = {p.name for p in inspect.signature(fn).parameters.values()
               if p.kind is p.KEYWORD_ONLY and p.name not in states}
    allowed |= {f"{s}_dtype" for s in states}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise _error(f"state_specs('{name}'): unknown options {unknown}", f"use some of {sorted(allowed)}")
    opt = {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
    opt.update(options)
    if name == "sgd":
        used = ["momentum_buffer"] if not _is_zero(opt["momentum"]) else []
        if used and not _is_zero(opt["dampening"]):
            used.append("step")
    elif name in ("adam", "lamb"):
        used = ["first_order", "second_order"] + (["step"] if opt["bias_correction"] else [])
        if name == "adam" and opt["amsgrad"]:
            used.append("max_second_order")
    else:
        used = ["square_avg"] + (["momentum_buffer"] if not _is_zero(opt["momentum"]) else [])
        used += ["grad_avg"] if opt["centered"] else []
    shape = tuple(int(d) for d in weight.shape)
    weight_dtype = from_any(weight.dtype)
    specs = {}
    for state in used:
        default = (torch.float32, ()) if state == "step" else (weight_dtype, shape)
        specs[state] = StateSpec(default[1], from_any(options.get(f"{state}_dtype", default[0])))
    return specs


# -- helpers -------------------------------------------------------------------------------
def _rule(rule: str | Callable[..., None]) -> tuple[str, Callable[..., None]]:
    for key, fn in RULES.items():
        if rule is fn or (isinstance(rule, str) and rule.lower().rstrip("_") == key):
            return ("adam" if key == "adamw" else key), fn
    raise _error(f"unknown optimiser rule {rule!r}", f"use one of {sorted(RULES)}")


def _error(what: str, fix: str) -> InvalidArgumentError:
    return InvalidArgumentError(what, where=user_source_line(), fix=fix)


def _is_zero(value: Any) -> bool:
    """True for the *number* 0 (a tensor may hold anything at run time)."""
    return not isinstance(value, Tensor) and value == 0


def _is_nonzero_number(value: Any) -> bool:
    return not isinstance(value, Tensor) and value != 0


def _check_hypers(rule: str, **hypers: Any) -> None:
    for key, value in hypers.items():
        if isinstance(value, Tensor):
            if value.shape != () or not value.dtype.is_floating_point:
                raise _error(f"{rule}: hyperparameter {key} must be a scalar float tensor, got "
                             f"{dtype_name(value.dtype)} {value.shape}",
                             f"pass a Python number or a shape-() float tensor for {key}")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _error(f"{rule}: hyperparameter {key} must be a number or a scalar tensor, got {value!r}",
                         f"pass {key} as a Python float or a shape-() float tensor")
        beta = key in ("beta1", "beta2")
        if value < 0 or (beta and value >= 1):  # torch.optim's checks
            raise _error(f"{rule}: invalid {key} value {value}", f"{key} must be in [0, 1)" if beta
                         else f"{key} must be >= 0")


def _require(rule: str, **states: Any) -> None:
    for key, value in states.items():
        if value is None:
            raise _error(f"{rule}: these options need the state tensor `{key}`",
                         f"pass {key}= (a zero-initialised variable; see ipuxl.optim.rules.state_specs)")


def _check_states(rule: str, weight: Tensor, **states: Tensor | None) -> None:
    for key, state in states.items():
        if state is not None and state.shape != weight.shape:
            raise InvalidArgumentError(
                f"{rule}: state `{key}` has shape {state.shape}, the weight '{weight.name}' {weight.shape}",
                where=user_source_line(), fix="create the state with the weight's shape (state_specs)")
        if state is not None and not state.dtype.is_floating_point:
            raise _error(f"{rule}: state `{key}` must be a float tensor, got {dtype_name(state.dtype)}",
                         "create the state with a float dtype (state_specs)")


def _compute_dtype(weight: Tensor, grad: Tensor) -> torch.dtype:
    return torch.promote_types(weight.spec.dtype, grad.spec.dtype)


#: ``_negated``'s cache: for a hyperparameter tensor's node, weak references to the node
#: holding its negation and to the last node of the graph when that was checked. Not
#: an IR fact (copies of a node must not inherit it), so it lives here, not in meta;
#: weak both ways, so it keeps no graph alive.
_NEGATIONS: "weakref.WeakKeyDictionary[fx.Node, tuple[weakref.ref[fx.Node], weakref.ref[fx.Node]]]" = \
    weakref.WeakKeyDictionary()


def _negated(value: Hyper) -> Hyper:
    """``-value``. A tensor (a learning-rate variable) is negated once in its graph and
    that result reused by the later updates, one ``neg`` op per step and param group
    instead of one per weight, as long as no op in between writes the tensor."""
    if not isinstance(value, Tensor):
        return -value
    cached = _NEGATIONS.get(value.node)
    if cached is not None:
        negated, checked = cached[0](), cached[1]()
        # fx marks an erased node only with its private ``_erased`` flag (a later pass may erase these)
        if (negated is not None and checked is not None and negated.graph is value.node.graph
                and not getattr(negated, "_erased", False) and not getattr(checked, "_erased", False)
                and not _written_after(value.node, checked)):
            _NEGATIONS[value.node] = (weakref.ref(negated), weakref.ref(_last_node(negated.graph)))
            return value.graph.wrap(negated)
    result = -value
    _NEGATIONS[value.node] = (weakref.ref(result.node), weakref.ref(result.node))
    return result


def _last_node(graph: fx.Graph) -> fx.Node:
    return next(iter(reversed(graph.nodes)))


def _written_after(source: fx.Node, start: fx.Node) -> bool:
    """True when an op after fx node ``start`` writes ``source``'s storage (or a view of it)."""
    root = storage_owner(source)
    node = start.next
    while node.op != "root":  # the fx graph's sentinel closes the list
        if any(storage_owner(w) is root for w in writes(node)):
            return True
        node = node.next
    return False


def _as(t: Tensor, dtype: DTypeLike) -> Tensor:
    """``t`` in ``dtype``: no op when it already is (a cast op otherwise)."""
    return t if t.dtype == dtype else cast(t, dtype)


def _scalar(value: Hyper, dtype: torch.dtype) -> Any:
    """A hyperparameter as a ``where`` operand of ``dtype`` (a float32 number stays a number)."""
    if isinstance(value, Tensor):
        return _as(value, dtype)
    return value if dtype == torch.float32 else constant(np.asarray(value, to_numpy_dtype(dtype)), dtype)


def _store(state: Tensor, value: Tensor) -> Tensor:
    """``state[...] = value`` rounded to ``state``'s dtype; returns the updated state."""
    return var_updates.copy_var_update_(state, _as(value, state.dtype))


def _moving_average_(state: Tensor, x: Tensor, f: Hyper, dtype: torch.dtype) -> Tensor:
    """``state = f * state + (1 - f) * x`` computed in ``dtype``."""
    if state.dtype == dtype:
        return var_updates.accumulate_moving_average_(state, x, f)
    return _store(state, scaled_add(_as(state, dtype), x, f, 1.0 - f))


def _moving_average_square_(state: Tensor, x: Tensor, f: Hyper, dtype: torch.dtype) -> Tensor:
    """``state = f * state + (1 - f) * x**2`` computed in ``dtype``."""
    if state.dtype == dtype:
        return var_updates.accumulate_moving_average_square_(state, x, f)
    return _store(state, scaled_add(_as(state, dtype), x * x, f, 1.0 - f))


def _axpby_(state: Tensor, x: Tensor, a: Hyper, b: Hyper, dtype: torch.dtype) -> Tensor:
    """``state = a * state + b * x`` computed in ``dtype``."""
    if state.dtype == dtype:
        return scaled_add_(state, x, a, b)
    return _store(state, scaled_add(_as(state, dtype), x, a, b))
