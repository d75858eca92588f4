"""``GraphCache``: one graph for every ``create_graph`` call with equal arguments.

Arguments are compared as upstream does: tensors by shape and dtype, bound graphs
by graph and bindings, containers element-wise, everything else by value.
"""
from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable

from ipuxl.addons_compat.graph import BoundGraph, GraphWithNamedArgs
from ipuxl.ir import context
from ipuxl.ir.graph import Graph
from ipuxl.ir.tensor import Tensor, TensorSpec

__all__ = ["GraphCache"]


def _argument_key(arg: Any) -> Any:
    if isinstance(arg, (Tensor, TensorSpec)):
        return ("tensor", tuple(arg.shape), arg.dtype)
    if isinstance(arg, BoundGraph):
        return ("bound", id(arg.graph), tuple(sorted((id(k), _argument_key(v)) for k, v in arg.args.items())))
    if isinstance(arg, GraphWithNamedArgs):
        return ("graph", id(arg.graph))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _argument_key(v)) for k, v in arg.items()))
    if isinstance(arg, (list, tuple)):
        return (type(arg).__name__, tuple(_argument_key(v) for v in arg))
    return arg


def _call_key(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    target = fn.build if hasattr(fn, "build") else fn
    bound = inspect.signature(target).bind(*args, **kwargs)
    bound.apply_defaults()
    return (id(fn), tuple((name, _argument_key(v)) for name, v in bound.arguments.items()))


class GraphCache:
    """Reuse graphs: ``cache.create_graph(fn, *args)`` builds once per distinct argument specs."""

    def __init__(self) -> None:
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def create_graph(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
        """The cached graph for ``fn`` and these argument specs, built on first use."""
        ir = context.gcg().ir
        graphs = self._graphs.setdefault(ir, {})
        key = _call_key(fn, args, kwargs)
        if key not in graphs:
            graphs[key] = ir.create_graph(fn, *args, **kwargs)
        return graphs[key]

    def __len__(self) -> int:
        return sum(len(g) for g in self._graphs.values())
