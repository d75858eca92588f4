"""A module call's arguments as pytree leaves: which are tensors, what they are called,
and which non-tensor values are baked into a trace.

A captured program takes the call's tensor leaves as inputs; every other leaf (an
int, a flag, ``None``...) is part of the program, so a change of one means a new
trace. ``FlatCall`` keeps both, and rebuilds the call with new tensors.
``forward_source`` points messages at the module's ``forward``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import torch
from torch.utils import _pytree as pytree

from ipuxl.capture.failures import error_class
from ipuxl.ir.context import user_source_line

__all__ = ["FlatCall", "flatten_call", "canonical_call", "input_names", "static_key", "forward_source"]


class FlatCall(NamedTuple):
    """One bound call: its arguments, their pytree leaves and spec, and the tensor leaves' positions."""

    bound: inspect.BoundArguments
    leaves: list[Any]
    spec: pytree.TreeSpec
    tensor_pos: list[int]

    def tensors(self) -> list[torch.Tensor]:
        """The call's tensor leaves, in order."""
        return [self.leaves[i] for i in self.tensor_pos]

    def with_tensors(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` of the same call with ``tensors`` in place of its tensor leaves."""
        leaves = list(self.leaves)
        for pos, value in zip(self.tensor_pos, tensors):
            leaves[pos] = value
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs

    def static_leaves(self) -> tuple[tuple[int, Any], ...]:
        """``(position, hashable value)`` of every non-tensor leaf: part of the program."""
        return tuple((i, static_key(leaf)) for i, leaf in enumerate(self.leaves) if i not in self.tensor_pos)


def flatten_call(module: torch.nn.Module, forward: Callable, args: tuple, kwargs: dict | None) -> FlatCall:
    """Bind a call of ``forward`` (a method of ``module``) and flatten its arguments.

    Raises:
        TraceError: the arguments do not fit ``forward``'s signature (also a ``TypeError``,
            as eager PyTorch raises).
    """
    try:
        bound = inspect.signature(forward).bind(*args, **dict(kwargs or {}))
    except TypeError as exc:
        name = type(module).__name__
        raise error_class(TypeError)(f"cannot call {name}.forward with the given inputs: {exc}",
                                     where=user_source_line(), fix=f"pass the arguments {name}.forward takes") from exc
    leaves, spec = pytree.tree_flatten((tuple(bound.args), dict(bound.kwargs)))
    return FlatCall(bound, leaves, spec, [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)])


def canonical_call(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of a call of ``module``, keyword arguments in ``forward``'s order.

    A capture names and orders its inputs by ``forward``'s signature (``flatten_call``),
    whatever order the caller wrote its keywords in; the host data of a call must be
    laid out the same way. Arguments that do not fit the signature are returned as
    given: capture refuses them with its own error.
    """
    if not kwargs:
        return args, kwargs
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    order = {name: i for i, name in enumerate(bound.arguments)}
    return args, dict(sorted(kwargs.items(), key=lambda item: order.get(item[0], len(order))))


def input_names(bound: inspect.BoundArguments) -> list[str]:
    """A name per tensor leaf: the parameter's name, or ``"name.k"`` for the k-th tensor
    inside a container argument."""
    names = []
    for key, value in bound.arguments.items():
        tensors = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
        if len(tensors) == 1 and isinstance(value, torch.Tensor):
            names.append(key)
        else:
            names.extend(f"{key}.{k}" for k in range(len(tensors)))
    return names


def static_key(value: Any) -> Any:
    """``value`` when hashable, else its ``repr`` (a key telling two static arguments apart)."""
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def forward_source(module: torch.nn.Module) -> str | None:
    """``"file.py:line in Class.forward"`` of the module's forward, for messages (None if unknown)."""
    try:
        fn = type(module).forward
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]} in {type(module).__name__}.forward"
    except (OSError, TypeError):
        return None
