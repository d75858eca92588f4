"""Emit one op into the current graph: the single place where fx nodes are created.

Every op of ``ipuxl.ops`` goes through :func:`emit`. It

1. finds the current graph and checks every tensor argument belongs to it;
2. runs the op's target on meta tensors, so output shapes and dtypes are known and
   shape errors surface at build time with the op, the input shapes and the user's
   source line;
3. records the fx node (program order), the user's name, source line and
   ``in_sequence`` flag, and for in-place ops which node they modify;
4. wraps the result(s) in ``Tensor`` handles.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map

from ipuxl.errors import InvalidArgumentError, ShapeMismatchError, WrongGraphError
from ipuxl.ir import context, placement
from ipuxl.ir.aliases import storage_owner
from ipuxl.ir.graph import Graph, identifier, describe
from ipuxl.ir.meta import IN_SEQUENCE, MODIFIES, NAME, OP, OP_ID, SOURCE, VIEW_OF, WRITES
from ipuxl.ir.tensor import Tensor

__all__ = ["emit", "check_same_graph", "check_same_shape", "check_writable"]


def emit(
    op_name: str,
    target: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    modifies: Tensor | None = None,
    writes: Sequence[Tensor] = (),
    aliases: Tensor | None = None,
    num_outputs: int | None = None,
    meta_fn: Callable[..., Any] | None = None,
) -> Any:
    """Add ``target(*args, **kwargs)`` to the current graph and return its Tensor(s).

    Args:
        op_name: the PopXL op name, used in messages and schedules.
        target: a torch/aten callable; it runs on meta tensors now and on data later.
        args, kwargs: arguments; ``Tensor`` handles become fx node references.
        name: the user's name for the output tensor.
        modifies: for in-place ops, the tensor they write to and return (an alias).
        writes: further tensors the op writes to as a side effect.
        aliases: the input the result shares storage with, where running on meta
            tensors cannot tell (``detach``); views are otherwise found automatically.
        num_outputs: when the target returns a sequence, how many Tensors to return.
        meta_fn: computes the output meta value instead of running ``target`` on meta
            tensors (for targets that cannot run on the meta device).

    Raises:
        WrongGraphError: (a ValueError and RuntimeError) a tensor argument belongs to another graph.
        InvalidArgumentError: an in-place op writes a constant or a view of one.
        ShapeMismatchError: the op cannot be built with these input shapes/dtypes.
    """
    graph = context.gcg()
    args, kwargs = tree_map(_numpy_scalar_to_python, (tuple(args), dict(kwargs or {})))
    if name is not None or context.name_scopes_open():
        name = context.scoped_name(name or op_name)
    check_same_graph(graph, op_name, args, kwargs)
    placement.check_inputs(graph, op_name, args, kwargs)
    if modifies is not None or writes:
        check_writable(graph, op_name, [modifies, *writes] if modifies is not None else list(writes))
    meta_args = tree_map(_to_meta, (tuple(args), dict(kwargs)))
    meta_out = _infer_meta(op_name, meta_fn or target, args, kwargs, meta_args)
    node_args = tree_map(_to_node, tuple(args))
    node_kwargs = tree_map(_to_node, dict(kwargs))
    _check_codegen_safe(op_name, (node_args, node_kwargs))
    node = graph.fx.create_node("call_function", target, node_args, node_kwargs,
                                name=identifier(name or op_name))
    _record(node, op_name, meta_out, name)
    placement.stamp(node, op=True)
    node.meta[OP_ID] = graph.ir.next_op_id()
    if modifies is not None:
        node.meta[MODIFIES] = storage_owner(modifies.node, views=False)
    elif aliases is not None:
        node.meta[VIEW_OF] = aliases.node
    else:
        _record_view(node, meta_out, args, kwargs, meta_args)
    written = ([modifies] if modifies is not None else []) + list(writes)
    if written:
        node.meta[WRITES] = [storage_owner(t.node, views=False) for t in written]
    graph.op_created(node)
    if num_outputs is None:
        return graph.wrap(node)
    return tuple(_getitem(graph, node, i, meta_out[i], name) for i in range(num_outputs))


def check_same_graph(graph: Graph, op_name: str, args: Any, kwargs: Any) -> None:
    """Raise if any tensor argument belongs to a graph other than ``graph``."""
    def check(value: Any) -> Any:
        if isinstance(value, Tensor) and value.graph is not graph:
            raise WrongGraphError(
                f"op '{op_name}' is being built in graph '{graph.name}' but its input "
                f"{describe(value)} belongs to graph '{value.graph.name}'",
                where=context.user_source_line(),
                fix="a subgraph cannot read another graph's tensors directly: make it a "
                    "graph input (ipuxl.graph_input or a create_graph argument) and pass the "
                    "tensor at the call site (ops.call(graph, ..., inputs_dict={...}))",
            )
        return value

    tree_map(check, (args, kwargs))


def check_writable(graph: Graph, op_name: str, written: Sequence[Tensor]) -> None:
    """Raise if an in-place op would write a constant, or a view of one (PopXL constants
    never change; PopART refuses to modify them). Variables, inputs and op results are fine."""
    for tensor in written:
        if not isinstance(tensor, Tensor):
            continue
        root = storage_owner(tensor.node)
        if root.op != "get_attr" or root.target not in graph.constant_data:
            continue
        name = root.meta.get(NAME, root.target)
        written_to = (f"constant '{name}'" if root is tensor.node
                      else f"{describe(tensor)}, a view of constant '{name}'")
        from ipuxl import ops  # ops are built on this module: bind late

        plain = op_name.rstrip("_")
        alternative = (f"use the out-of-place op ops.{plain} (it returns a new tensor)"
                       if op_name.endswith("_") and callable(getattr(ops, plain, None))
                       else "compute a new tensor out of place instead")
        line = context.user_source_line()
        raise InvalidArgumentError(
            f"op '{op_name}' writes in place to {written_to}, and constants never change "
            "(PopXL refuses to modify a constant)",
            where=f"{line}, constant '{name}'" if line else f"constant '{name}'",
            fix=f"make '{name}' a variable with ipuxl.variable(...) if it must change, or {alternative}",
        )


def _infer_meta(op_name: str, fn: Callable[..., Any], args: Any, kwargs: Any, meta_args: Any) -> Any:
    try:
        return fn(*meta_args[0], **meta_args[1])
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        inputs = ", ".join(describe(a) for a in _flat_tensors(args, kwargs)) or "no tensor inputs"
        raise ShapeMismatchError(
            f"op '{op_name}' cannot be built with inputs {inputs}: {str(exc).splitlines()[0]}",
            where=context.user_source_line(),
            fix="check the shapes and dtypes of the op's inputs (PopXL ops follow numpy "
                "broadcasting; cast with ops.cast where dtypes differ)",
        ) from None


def _record(node: fx.Node, op_name: str, meta_out: Any, name: str | None) -> None:
    node.meta["val"] = meta_out
    node.meta[OP] = op_name
    if name:
        node.meta[NAME] = name
    node.meta[SOURCE] = context.user_source_line()
    if context.in_sequence_enabled():
        node.meta[IN_SEQUENCE] = True


def _record_view(node: fx.Node, meta_out: Any, args: Any, kwargs: Any, meta_args: Any) -> None:
    """Mark ``node`` as a view of the input whose storage its result shares.

    torch returns views (reshape, slicing, transpose...) or the input itself
    (``.to`` of the same dtype) where PopXL ops return new tensors; lowering
    copies such a view when an in-place op later writes through it, so the
    source keeps PopXL's value. Running on meta tensors tells which outputs alias.
    """
    inputs = [(t, m) for t, m in zip(_flat_tensors(args, kwargs), _flat_meta(meta_args))]
    outs = [meta_out] if isinstance(meta_out, torch.Tensor) else list(meta_out) if isinstance(meta_out, (tuple, list)) else []
    for out in outs:
        if not isinstance(out, torch.Tensor):
            continue
        base = out._base if out._base is not None else out
        for tensor, meta in inputs:
            if base is meta or base is meta._base:
                node.meta[VIEW_OF] = tensor.node
                return


def _flat_meta(meta_args: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda v: found.append(v) if isinstance(v, torch.Tensor) else v, meta_args)
    return found


def _getitem(graph: Graph, node: fx.Node, i: int, meta: Any, name: str | None) -> Tensor:
    item = graph.fx.create_node("call_function", operator.getitem, (node, i), {},
                                name=f"{node.name}_{i}")
    item.meta["val"] = meta
    item.meta[OP] = "output_of"
    if VIEW_OF in node.meta:
        item.meta[VIEW_OF] = node.meta[VIEW_OF]
    if name:
        item.meta[NAME] = f"{name}_{i}"
    return graph.wrap(item)


# Leaves an fx node may hold as arguments: the generated code writes them as Python source
# (anything else prints as a repr that names nothing, and fails only when the program runs).
_CODEGEN_SAFE = (fx.Node, int, float, complex, str, type(None), type(...), slice, range, torch.dtype,
                 torch.device, torch.memory_format, torch.layout)


def _numpy_scalar_to_python(value: Any) -> Any:
    """A numpy scalar (``np.float32(0.5)``) as the Python number it holds, as ops take them."""
    return value.item() if isinstance(value, np.generic) else value


def _check_codegen_safe(op_name: str, args: Any) -> None:
    for leaf in tree_leaves(args):
        if not isinstance(leaf, _CODEGEN_SAFE) and not callable(leaf):
            raise InvalidArgumentError(
                f"op '{op_name}' got an argument of type {type(leaf).__name__} ({leaf!r:.60}) where it takes "
                "a tensor, a number, a string or a dtype", where=context.user_source_line(),
                fix=f"check the arguments of '{op_name}' against its signature (an argument in the wrong place?)")


def _to_node(value: Any) -> Any:
    return value.node if isinstance(value, Tensor) else value


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        meta = value.node.meta["val"]
        if meta.is_contiguous():  # the common case; empty_like works out the memory format (slow)
            return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
        return torch.empty_like(meta, device="meta")
    return value


def _flat_tensors(args: Any, kwargs: Any) -> list[Tensor]:
    found: list[Tensor] = []
    tree_map(lambda v: found.append(v) if isinstance(v, Tensor) else v, (args, kwargs))
    return found


def check_same_shape(op_name: str, target: Tensor, value: Tensor) -> None:
    """PopXL's in-place updates do not broadcast: ``value`` must have ``target``'s shape."""
    if isinstance(value, Tensor) and target.shape != value.shape:
        raise ShapeMismatchError(
            f"op '{op_name}' needs tensors of one shape (in-place updates do not broadcast): "
            f"{describe(target)} vs {describe(value)}",
            where=context.user_source_line(),
            fix=f"reshape or slice '{value.name}' to {target.shape} first",
        )
