"""A compiled model's call: how its arguments bind to ``forward``, and how a later call is
checked against the call the program was compiled for.

``bind_call`` binds a call to ``forward``'s signature with the defaults filled in (a
tensor default is an input of the program), as PopTorch's ``ArgsParser`` does: the positional arguments (``*args`` entries named
``*args[i]``) and the named ones (keyword-only parameters and ``**kwargs`` entries).
So ``m(x)`` and ``m(x, t=None)`` are the same call of ``forward(self, x, t=None)``.

``CompiledCall`` remembers the compiled call (tensors by shape and dtype, every other
value as it was) and ``match`` maps a new call onto it:

* PopTorch's contract (``poptorch_contract``: the program imported ``poptorch``, as
  Graphcore's programs run through ``ipuxl.compat``): the program's inputs are fixed once
  compiled. A call whose flattened tensors (shapes, dtypes, order) and other values are
  the compiled ones runs the program, whatever containers hold them (``m((x,))`` then
  ``m(x)``), as PopTorch feeds its executable the flattened tensors; dict arguments may
  list their keys in another order. Any other difference raises ``ExecutorError`` (a
  ``poptorch.Error``) with PopTorch's message: "Shape mismatch for t[0]: expected
  torch.Size([1]) but got torch.Size([2])", "Data type mismatch ...", "Keys mismatch for
  named arguments: Missing arguments: z.", "Value mismatch for u: expected 5 but got 3",
  "Number of positional arguments mismatch: expected 5 arguments but got 4"...
  ``destroy()`` and calling again compiles for the new inputs, as upstream.
* ipuxl's own API (``ipuxl.trainingModel``... without ``import poptorch``): a call that
  differs (other than by a dict's key order) compiles the program again for it (refused
  under ``Options.staticShapes``): calls keep eager PyTorch's semantics.
"""
from __future__ import annotations

import inspect
import logging
import sys
import types
import weakref
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from ipuxl.capture.failures import error_class
from ipuxl.errors import ExecutorError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.custom_args import register_subclasses

__all__ = ["BoundCall", "CompiledCall", "bind_call", "forward_signature", "keyword_form", "poptorch_contract",
           "refuse_zero_sized", "warn_inputs_requiring_grad"]

_LOG = logging.getLogger("poptorch::python")

_FIX = ("the inputs of a call must match those the model was compiled for (its first call); to compile "
        "for new inputs, call destroy() on the model, or wrap the module again")


def poptorch_contract() -> bool:
    """Whether the running program imported ``poptorch`` (``ipuxl.compat``): its models keep
    PopTorch's fixed-input contract (see the module docstring)."""
    module = sys.modules.get("poptorch")
    return module is not None and getattr(module, "__name__", "") == "ipuxl.poptorch_compat"


def refuse_zero_sized(module: torch.nn.Module, call: tuple[tuple, dict[str, Any]]) -> None:
    """PopTorch's refusal of an input, parameter or buffer with a zero-sized dimension (its
    dispatcher cannot add one to the graph), under PopTorch's contract; ipuxl's own API runs
    them as eager PyTorch does.

    Raises:
        TraceError: the first such tensor (PopTorch's message, a ``poptorch.Error``).
    """
    named = [(f"input {i}", t) for i, t in enumerate(pytree.tree_leaves(call))]
    named += [(f"parameter '{n}'", t) for n, t in module.named_parameters()]
    named += [(f"buffer '{n}'", t) for n, t in module.named_buffers()]
    for name, tensor in named:
        if isinstance(tensor, torch.Tensor) and 0 in tensor.shape:
            raise error_class(RuntimeError)(
                f"Zero-sized tensors are unsupported (Got shape [{', '.join(map(str, tensor.shape))}]).",
                where=user_source_line(),
                fix=f"{name} has a dimension of size 0: give the model tensors of at least one element (ipuxl's own "
                    "API, without `import poptorch`, runs zero-sized tensors as eager PyTorch does)")


def warn_inputs_requiring_grad(call: tuple[tuple, dict[str, Any]]) -> None:
    """Upstream's warning, once per input tensor of a compiled call, for an input that
    requires grad: the device program takes its value only (no gradient flows back to it)."""
    for leaf in pytree.tree_leaves(call):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            _LOG.warning("Input tensor has requires_grad=True set. This tensor will be detached because "
                         "backward pass via inputs is not supported.")


class BoundCall(NamedTuple):
    """One call bound to ``forward`` (defaults filled in).

    Attributes:
        positional: ``(name, value)`` of each positional argument, in order.
        named: the keyword-only and ``**kwargs`` arguments.
    """

    positional: list[tuple[str, Any]]
    named: dict[str, Any]

    @property
    def args(self) -> tuple:
        return tuple(value for _, value in self.positional)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.named)


_SIGNATURES: "weakref.WeakKeyDictionary[Any, inspect.Signature]" = weakref.WeakKeyDictionary()


def forward_signature(module: torch.nn.Module) -> inspect.Signature:
    """``inspect.signature(module.forward)``, read once per ``forward`` function: every call of a
    compiled model binds its arguments with it (a bound method's signature is its function's
    without ``self``, the same for every instance).

    Raises:
        TypeError, ValueError: as ``inspect.signature`` (no signature can be read).
    """
    forward = module.forward
    if not isinstance(forward, types.MethodType) or not isinstance(forward.__func__, types.FunctionType):
        return inspect.signature(forward)  # a callable object or a builtin: not cached
    signature = _SIGNATURES.get(forward.__func__)
    if signature is None:
        signature = _SIGNATURES[forward.__func__] = inspect.signature(forward)
    return signature


def bind_call(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> BoundCall:
    """Bind a call of ``module`` to its ``forward`` (see the module docstring); other
    arguments that do not fit the signature are kept as given (capture refuses them).

    Raises:
        TraceError: a parameter without default is not given (PopTorch's message; also a
            ``TypeError``, as eager PyTorch raises).
    """
    try:
        signature = forward_signature(module)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        missing = _missing_parameter(module, args, kwargs)
        if missing is not None:
            raise error_class(TypeError)(f"Mandatory parameter {missing} missing", where=user_source_line(),
                                         fix=f"pass {missing} to {type(module).__name__}.forward") from None
        return BoundCall([(f"arg{i}", a) for i, a in enumerate(args)], dict(kwargs))
    bound.apply_defaults()  # a tensor default too: an input of the program, as upstream
    positional: list[tuple[str, Any]] = []
    named: dict[str, Any] = {}
    for name in [n for n in signature.parameters if n in bound.arguments]:  # forward's order
        value, kind = bound.arguments[name], signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            positional += [(f"*{name}[{i}]", v) for i, v in enumerate(value)]
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.KEYWORD_ONLY:
            named[name] = value
        else:
            positional.append((name, value))
    return BoundCall(positional, named)


def keyword_form(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A bound call as the program calls ``forward``: the parameters that can be named, by name
    (positional-only ones, and every argument of a ``forward`` with ``*args``, stay positional),
    less those holding their own (non-tensor) default, which ``forward`` fills in itself.

    Library wrappers of ``forward`` may add a named argument themselves (Hugging Face's
    ``merge_with_config_defaults`` adds ``use_cache=`` unless it was named): a value passed by
    position, or its default passed explicitly, would then arrive twice or hide the config's.
    """
    try:
        parameters = list(forward_signature(module).parameters.values())
    except (TypeError, ValueError):
        return args, kwargs
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return args, kwargs
    named = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    lead = sum(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in parameters)
    if len(args) > lead + len(named):
        return args, kwargs
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty
                and not isinstance(p.default, torch.Tensor)}
    given = {**{p.name: value for p, value in zip(named, args[lead:])}, **kwargs}
    return args[:lead], {k: v for k, v in given.items() if not (k in defaults and v is defaults[k])}


def _missing_parameter(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """The first parameter of ``forward`` without default that the call does not give."""
    try:
        parameters = list(forward_signature(module).parameters.values())
    except (TypeError, ValueError):
        return None
    for position, parameter in enumerate(parameters):
        if parameter.default is not inspect.Parameter.empty or parameter.name in kwargs:
            continue
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            if position >= len(args):
                return parameter.name
        elif parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            return parameter.name
    return None


class _Tensor:
    """A compiled tensor argument: its shape and dtype."""

    __slots__ = ("shape", "dtype")

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype = tensor.shape, tensor.dtype

    def matches(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.shape == self.shape and value.dtype == self.dtype


class _Custom:
    """A compiled argument of a type whose tensors pytree reaches (``ICustomArgParser``)."""

    __slots__ = ("leaves",)

    def __init__(self, leaves: tuple):
        self.leaves = leaves


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Tensor(value)
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_spec(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _spec(v) for k, v in value.items()}
    leaves = pytree.tree_leaves(value)
    if len(leaves) != 1 or leaves[0] is not value:
        return _Custom(tuple(_spec(leaf) for leaf in leaves))
    return value


class _Mark:
    """A leaf's position in the compiled call (to find where the leaves go, see ``_sorted_leaves``)."""

    __slots__ = ("position",)

    def __init__(self, position: int):
        self.position = position


def _sorted_leaves(value: Any) -> list[Any]:
    """``value``'s leaves, as ``pytree.tree_leaves`` gives them but with each dict's keys in
    sorted order: the same for two calls whose dicts list their keys in other orders."""
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _sorted_leaves(item)]
    if isinstance(value, dict):
        return [leaf for key in sorted(value, key=repr) for leaf in _sorted_leaves(value[key])]
    return pytree.tree_leaves(value)


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - a comparison that does not give one bool: not the same value
        return False


def _refuse(what: str) -> ExecutorError:
    return ExecutorError(what, where=user_source_line(), fix=_FIX)


def _type_name(spec: Any) -> str:
    return str(torch.Tensor if isinstance(spec, _Tensor) else type(spec))


def _validate(name: str, compiled: Any, value: Any, named: bool = False) -> Any:
    """``value`` laid out as ``compiled`` (dict keys in the compiled order); raises
    PopTorch's error for the first difference."""
    if isinstance(compiled, _Tensor):
        if not isinstance(value, torch.Tensor):
            raise _refuse(f"Type mismatch for {name}: expected {_type_name(compiled)} but got {type(value)}.")
        if value.dtype != compiled.dtype:
            raise _refuse(f"Data type mismatch for {name}: expected {compiled.dtype} but got {value.dtype}.")
        if value.shape != compiled.shape:
            raise _refuse(f"Shape mismatch for {name}: expected {compiled.shape} but got {value.shape}.")
        return value
    if isinstance(compiled, _Custom):
        leaves = pytree.tree_leaves(value)
        _validate(name, tuple(compiled.leaves), tuple(leaves))
        return value
    if isinstance(compiled, (tuple, list, dict)) and type(compiled) is not type(value):
        raise _refuse(f"Type mismatch for {name}: expected {type(compiled)} but got {type(value)}.")
    if isinstance(compiled, (tuple, list)):
        if len(compiled) != len(value):
            raise _refuse(f"Length mismatch for {name}: expected {len(compiled)} elements but got {len(value)}.")
        return type(compiled)(_validate(f"{name}[{i}]", c, v) for i, (c, v) in enumerate(zip(compiled, value)))
    if isinstance(compiled, dict):
        extra, missing = set(value) - set(compiled), set(compiled) - set(value)
        if extra or missing:
            details = ([f"Unexpected arguments: {', '.join(sorted(map(str, extra)))}"] if extra else []) + \
                      ([f"Missing arguments: {', '.join(sorted(map(str, missing)))}"] if missing else [])
            raise _refuse(f"Keys mismatch for {name}: {'. '.join(details)}.")
        return {k: _validate(str(k) if named else f"{name}[{k}]", c, value[k]) for k, c in compiled.items()}
    if isinstance(value, torch.Tensor):
        raise _refuse(f"Type mismatch for {name}: expected {type(compiled)} but got {torch.Tensor}.")
    if not _same(compiled, value):
        raise _refuse(f"Value mismatch for {name}: expected {compiled} but got {value}.")
    return value


class CompiledCall:
    """The call a program was compiled for (see the module docstring)."""

    def __init__(self, call: BoundCall):
        register_subclasses((call.args, call.kwargs))
        self._positional = [(name, _spec(value)) for name, value in call.positional]
        self._named = {name: _spec(value) for name, value in call.named.items()}
        leaves, self._tree = pytree.tree_flatten((call.args, call.kwargs))
        marks = _sorted_leaves(pytree.tree_unflatten([_Mark(i) for i in range(len(leaves))], self._tree))
        self._order = [mark.position for mark in marks]  # the compiled position of each sorted leaf
        self._leaves = [_Tensor(leaves[i]) if isinstance(leaves[i], torch.Tensor) else leaves[i] for i in self._order]

    def _flat(self, call: BoundCall) -> tuple[tuple, dict[str, Any]] | None:
        """``call`` in the compiled containers when its flattened values are the compiled ones."""
        leaves = _sorted_leaves((call.args, call.kwargs))
        if len(leaves) != len(self._leaves):
            return None
        for was, now in zip(self._leaves, leaves):
            if isinstance(was, _Tensor) != isinstance(now, torch.Tensor):
                return None
            if not (was.matches(now) if isinstance(was, _Tensor) else _same(was, now)):
                return None
        placed: list[Any] = [None] * len(leaves)
        for position, leaf in zip(self._order, leaves):
            placed[position] = leaf
        args, kwargs = pytree.tree_unflatten(placed, self._tree)
        return args, kwargs

    def validate(self, call: BoundCall) -> tuple[tuple, dict[str, Any]]:
        """``call`` laid out as the compiled one (PopTorch's ``validateInputs``).

        Raises:
            ExecutorError: the call differs from the compiled one (PopTorch's message).
        """
        if len(call.positional) != len(self._positional):
            raise _refuse(f"Number of positional arguments mismatch: expected {len(self._positional)} arguments "
                          f"but got {len(call.positional)}.")
        args = tuple(_validate(name, spec, value)
                     for (name, spec), (_, value) in zip(self._positional, call.positional))
        kwargs = _validate("named arguments", self._named, call.named, named=True)
        return args, kwargs

    def match(self, call: BoundCall, *, fixed: bool) -> tuple[tuple, dict[str, Any]]:
        """The ``(args, kwargs)`` to run for ``call``: laid out as the compiled call when it
        is the same call; with ``fixed`` (PopTorch's contract) a different call raises,
        else it is returned as it is (it compiles again).

        Raises:
            ExecutorError: ``fixed`` and the call differs (PopTorch's message).
        """
        register_subclasses((call.args, call.kwargs))
        try:
            return self.validate(call)
        except ExecutorError:
            flat = self._flat(call) if fixed else None
            if flat is not None:
                return flat
            if fixed:
                raise
            return call.args, call.kwargs
