"""``GraphCache``: one graph for every ``create_graph`` call with equal arguments.

Keyed as upstream keys it: the function's (or module's) ``__hash__`` -- so two module
instances with equal hashes share a graph --, the current IPU (``popxl.ipu``) and tile set
(``popxl.io_tiles``), and each argument: tensors by shape, dtype and meta shape, bound
graphs by graph and bindings, containers element-wise, everything else by ``hash``.
"""
from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable

from ipuxl.addons_compat.graph import BoundGraph, GraphWithNamedArgs
from ipuxl.ir import context, placement
from ipuxl.ir.graph import Graph
from ipuxl.ir.tensor import Tensor, TensorSpec

__all__ = ["GraphCache"]


def _argument_key(arg: Any) -> Any:
    if isinstance(arg, (Tensor, TensorSpec)):
        return ("tensor", tuple(arg.shape), arg.dtype, tuple(arg.meta_shape or ()))
    if isinstance(arg, BoundGraph):
        return ("bound", id(arg.graph), tuple(sorted((id(k), _argument_key(v)) for k, v in arg.args.items())))
    if isinstance(arg, GraphWithNamedArgs):
        return ("graph", id(arg.graph))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _argument_key(v)) for k, v in arg.items()))
    if isinstance(arg, (list, tuple)):
        return (type(arg).__name__, tuple(_argument_key(v) for v in arg))
    return ("hash", hash(arg))  # as upstream: equal hashes share a graph


def _call_key(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    """The cache key of ``create_graph(fn, *args, **kwargs)`` built here (upstream's
    ``get_function_hash``: ``hash(fn)``, the IPU and tile set, then each bound argument)."""
    target = fn.build if hasattr(fn, "build") else fn
    bound = inspect.signature(target).bind(*args, **kwargs)
    bound.apply_defaults()
    tile_set = "io" if placement.in_io_tiles() else "compute"
    return (hash(fn), placement.current_ipu(), tile_set,
            tuple((name, _argument_key(v)) for name, v in bound.arguments.items()))


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
