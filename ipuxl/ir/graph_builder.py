"""PopXL-style graph building: ``create_graph``, ``graph_input``, variables, constants.

``Ir.create_graph(fn, *args, **kwargs)`` calls ``fn`` inside a new graph. Each
argument that is a ``Tensor``/``TensorSpec`` (or a list of them, or wrapped in
``TensorByRef``) becomes a graph input named after its parameter, in signature
order; plain Python values are passed through. The tensors given only describe
shapes and dtypes: the caller connects real tensors at each call site.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torch.fx as fx

from ipuxl import fp8_utils
from ipuxl.dtypes import DOWNCAST, FLOAT8, DTypeLike, check_supported, float8_options, from_any, to_numpy_dtype
from ipuxl.errors import InvalidArgumentError, InvalidValueError, ReplicationError, WrongGraphError
from ipuxl.ir import context, placement
from ipuxl.ir.memmap import check_memmap, warn_non_const_grouping
from ipuxl.ir.meta import NAME, ROLE, SOURCE, Role
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.tensor import Constant, Tensor, TensorByRef, TensorSpec, Variable

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir

__all__ = ["build_graph", "graph_input", "graph_output", "variable", "given_variable", "constant", "Module",
           "grouped_shape", "host_array"]

class Module:
    """PopXL's ``Module``: override ``build``; ``ir.create_graph(module, ...)`` traces it.

    Example:
        >>> class Scale(Module):
        ...     def build(self, x):
        ...         self.w = graph_input(x.shape, x.dtype, "w")
        ...         return x * self.w
    """

    def build(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("your ipuxl.Module must override `build`")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.build(*args, **kwargs)


def build_graph(ir: "Ir", fn: Callable[..., Any], args: tuple, kwargs: dict) -> "Graph":
    """Implementation of ``Ir.create_graph`` (see the module docstring)."""
    target = fn.build if isinstance(fn, Module) else fn
    name = type(fn).__qualname__ if isinstance(fn, Module) else getattr(fn, "__qualname__", "graph")
    graph = ir.new_subgraph(name.replace(".<locals>", ""))
    bound = _bind(target, name, args, kwargs)
    by_ref = _by_ref_params(target)
    var_keyword = {p.name for p in inspect.signature(target).parameters.values() if p.kind is p.VAR_KEYWORD}
    with graph:
        for param, value in bound.arguments.items():
            if param in var_keyword:  # **kwargs: one input per tensor, named by its key
                bound.arguments[param] = {k: _as_inputs(graph, k, v, param in by_ref) for k, v in value.items()}
            else:
                bound.arguments[param] = _as_inputs(graph, param, value, by_ref=param in by_ref)
        result = target(*bound.args, **bound.kwargs)
        for output in _outputs(graph, name, result):  # after any marked with graph_output
            graph.add_output(output)
    return graph


def graph_input(shape: Any, dtype: DTypeLike, name: str | None = None,
                by_ref: bool = False, meta_shape: Any = None) -> Tensor:
    """Add an input of ``shape`` and ``dtype`` to the current graph."""
    graph = context.gcg()
    spec = TensorSpec(tuple(shape), dtype, tuple(meta_shape or ()))
    return graph.add_input(spec, context.scoped_name(name or "t"), by_ref=by_ref)


def graph_output(t: Tensor) -> None:
    """Mark ``t`` as the next output of the current graph (PopXL's ``graph_output``).

    Outputs marked this way come before those the graph function returns.

    Raises:
        WrongGraphError: (a ValueError) ``t`` is not a tensor of the current graph.
    """
    graph = context.gcg()
    if not isinstance(t, Tensor):
        raise InvalidArgumentError(f"graph_output needs a Tensor, got {type(t).__name__}",
                                   where=context.user_source_line())
    if t.graph is not graph:
        raise WrongGraphError(
            f"graph_output of tensor '{t.name}' of graph '{t.graph.name}' while building graph '{graph.name}'",
            where=context.user_source_line(),
            fix="mark a tensor computed in the graph being built")
    graph.add_output(t)


def variable(data: Any, dtype: DTypeLike | None = None, name: str | None = None,
             downcast: bool = True, replica_grouping: "ReplicaGrouping | None" = None,
             retrieval_mode: str | None = None, log2_scale: int | None = None,
             nan_on_overflow: bool | None = None) -> Variable:
    """Create a variable in the main graph, initialised with a copy of ``data``.

    Every replica holds its own copy. With a ``replica_grouping`` of G > 1 groups,
    ``data`` holds one value per group, shaped ``(G, *shape)``; ``retrieval_mode``
    ("one_per_group", the default, or "all_replicas") sets what
    ``Session.get_tensor_data`` returns, as in PopXL.

    Raises:
        WrongGraphError: (a ValueError) outside the main graph (variables live only there).
        ReplicationError: a grouping of another replica count, or data without the
            group dimension.
        UnsupportedError: (a RuntimeError) ``log2_scale`` or ``nan_on_overflow`` is set
            for a dtype that is not float8.

    For a float8 ``dtype`` (``float8_143``, ``float8_152``), float data are cast on the host
    as ``fp8_utils.host_pow2scale_cast_to_fp8(data, dtype, log2_scale, nan_on_overflow)``
    (defaults 0 and True); float8 host data of that dtype are taken as they are.
    """
    return _variable(data, dtype, name, downcast, replica_grouping, retrieval_mode, given=False,
                     float8=(log2_scale, nan_on_overflow))


def given_variable(array: np.ndarray, dtype: DTypeLike, name: str) -> Variable:
    """``variable(array, dtype, name=name, downcast=False)`` for an array its caller gives
    to the IR: kept as the variable's initial host data, not copied, when it is contiguous,
    writable and of the variable's dtype. The caller's promise: nothing writes the array
    behind the IR's back before a session has been made from it, or only as the program's
    own host side (PopTorch's host model: its weights start the program). A model's weights
    are then not copied again, and optimiser state made by ``np.zeros`` holds no memory
    until written."""
    return _variable(array, dtype, name, False, None, None, given=True)


def _variable(data: Any, dtype: DTypeLike | None, name: str | None, downcast: bool, replica_grouping: Any,
              retrieval_mode: str | None, given: bool,
              float8: tuple[int | None, bool | None] = (None, None)) -> Variable:
    graph = context.gcg()
    if not graph.is_main:
        raise WrongGraphError(
            f"variable '{name or 'variable'}' created in subgraph '{graph.name}': variables "
            "can only be created in the main graph",
            where=context.user_source_line(),
            fix="create it under `with ir.main_graph:` and pass it to the subgraph as an "
                "input (ipuxl.graph_input), or use ipuxl.constant",
        )
    array, torch_dtype = host_array(data, dtype, downcast, f"variable '{name or 'variable'}'", keep_memmap=True,
                                    given=given, log2_scale=float8[0], nan_on_overflow=float8[1])
    warn_non_const_grouping(data, replica_grouping)
    ir = graph.ir
    shape = grouped_shape(ir, name or "variable", array.shape, replica_grouping, retrieval_mode)
    attr = ir.unique_name(set(ir.variable_records) | set(graph.constant_data), _attr_name(name or "t"))
    node = graph.fx.get_attr(attr)
    _record_leaf(node, shape, torch_dtype, _unique_leaf_name(name, attr), Role.VARIABLE)
    tensor = graph.wrap(node, Variable)
    ir.record_variable(attr, tensor, array, replica_grouping, retrieval_mode or "one_per_group")
    return tensor


def grouped_shape(ir: "Ir", name: str, data_shape: tuple[int, ...], grouping: Any,
                   retrieval_mode: str | None) -> tuple[int, ...]:
    """The per-replica shape of a variable whose data holds one value per group (``variable``,
    ``ir.remote``'s variables): the data's, less the leading group axis when there are several groups."""
    if retrieval_mode not in (None, "one_per_group", "all_replicas"):
        raise InvalidArgumentError(f"variable '{name}': retrieval_mode {retrieval_mode!r} is not known",
                                   where=context.user_source_line(),
                                   fix="use 'one_per_group' or 'all_replicas'")
    if grouping is None:
        return tuple(data_shape)
    if not isinstance(grouping, ReplicaGrouping):
        raise InvalidArgumentError(f"variable '{name}': replica_grouping must be a ReplicaGrouping, "
                                   f"got {type(grouping).__name__}", where=context.user_source_line(),
                                   fix="make one with ir.replica_grouping(stride, group_size)")
    if grouping.replication_factor != ir.replication_factor:
        raise ReplicationError(
            f"variable '{name}': {grouping} is for {grouping.replication_factor} replicas, the Ir has "
            f"{ir.replication_factor}", where=context.user_source_line(),
            fix="create the grouping with this Ir's ir.replica_grouping(...)")
    if grouping.num_groups == 1:
        return tuple(data_shape)
    if not data_shape or data_shape[0] != grouping.num_groups:
        raise ReplicationError(
            f"variable '{name}': {grouping} has {grouping.num_groups} groups, so the data needs a leading "
            f"dimension of {grouping.num_groups}; got data of shape {tuple(data_shape)}",
            where=context.user_source_line(),
            fix=f"stack one value per group: data of shape ({grouping.num_groups}, *variable_shape)")
    return tuple(data_shape[1:])


def constant(data: Any, dtype: DTypeLike | None = None, name: str | None = None,
             downcast: bool = True) -> Constant:
    """Create a constant tensor in the current graph."""
    graph = context.gcg()
    array, torch_dtype = host_array(data, dtype, downcast, f"constant '{name or 'constant'}'")
    attr = graph.ir.unique_name(set(graph.constant_data) | set(graph.ir.variable_records), _attr_name(name or "t"))
    graph.constant_data[attr] = fp8_utils.to_tensor(array).to(torch_dtype)
    node = graph.fx.get_attr(attr)
    _record_leaf(node, array.shape, torch_dtype, _unique_leaf_name(name, attr), Role.CONSTANT)
    return graph.wrap(node, Constant)


# -- helpers ----------------------------------------------------------------------------
def _bind(target: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    try:
        bound = inspect.signature(target).bind(*args, **kwargs)
    except TypeError as exc:
        raise InvalidValueError(
            f"The arguments, `args` and `kwargs`, do not match the signature of the function `{name}`: {exc}",
            where=context.user_source_line(),
            fix=f"pass the arguments `{name}` expects: {inspect.signature(target)}",
        ) from None
    bound.apply_defaults()
    return bound


def _by_ref_params(target: Callable[..., Any]) -> set[str]:
    """Parameters annotated ``TensorByRef`` (or a list/tuple of it), as in PopXL."""
    found = set()
    for param in inspect.signature(target).parameters.values():
        annotation = param.annotation
        text = annotation if isinstance(annotation, str) else repr(annotation)
        if annotation is TensorByRef or "TensorByRef" in text:
            found.add(param.name)
    return found


def _as_inputs(graph: "Graph", param: str, value: Any, by_ref: bool = False) -> Any:
    """Turn one create_graph argument into graph input(s), or pass it through."""
    if isinstance(value, TensorByRef):
        return _as_inputs(graph, param, value.value, by_ref=True)
    if isinstance(value, (Tensor, TensorSpec)):
        spec = value.spec if isinstance(value, Tensor) else value
        return graph.add_input(spec, param, by_ref=by_ref)
    tensor_like = (Tensor, TensorSpec, TensorByRef)
    if isinstance(value, (list, tuple)) and any(isinstance(v, tensor_like) for v in value):
        if not all(isinstance(v, tensor_like) for v in value):
            raise InvalidArgumentError(
                f"A {type(value).__name__} argument can't contain a mixture of Tensors and other types. Arg name: "
                f"{param}. Value: {value!r}", where=context.user_source_line(),
                fix="pass the tensors in one argument and the other values in others")
        return type(value)(_as_inputs(graph, f"{param}_{i}", v, by_ref) for i, v in enumerate(value))
    # anything else (a number, a dict, a graph to code-load, a numpy array...) is passed through, as in PopXL
    return value


def _outputs(graph: "Graph", name: str, result: Any) -> list[Tensor]:
    if result is None:
        return []
    items = [result] if isinstance(result, Tensor) else list(result) if isinstance(result, (list, tuple)) else None
    if items is None or not all(isinstance(t, Tensor) for t in items):
        raise InvalidValueError(
            f"Output of subgraph must be None, a Tensor or an iterable of Tensors. Output type: "
            f"{type(result).__name__} (returned by `{name}`). Value {result!r}",
            where=context.user_source_line(),
            fix="return the Tensors the graph should output",
        )
    for t in items:
        if t.graph is not graph:
            raise WrongGraphError(
                f"`{name}` returned tensor '{t.name}' of graph '{t.graph.name}', not of the graph being built",
                fix="return tensors computed inside the graph function",
            )
    return items


def host_array(data: Any, dtype: Any, downcast: bool, subject: str, keep_memmap: bool = False,
               given: bool = False, log2_scale: int | None = None,
               nan_on_overflow: bool | None = None) -> tuple[np.ndarray, torch.dtype]:
    """A private host copy of ``data`` and the device dtype (PopXL's downcast rule), for a
    variable or constant (``ipuxl.variable``, ``constant``, ``ir.remote``'s variables).

    ``keep_memmap``: a writable ``np.memmap`` already of the device's host dtype is kept,
    not copied: a variable's host value then lives in its file (``Session.weights_to_host``
    writes it there and flushes it, as PopXL); a memmap that would need a conversion is
    refused (``ir.memmap``). ``given``: a numpy
    array the caller gives away is kept when it owns its contiguous, writable memory and
    has the target dtype (``given_variable``). For a float8 target, float data are cast as
    ``fp8_utils.host_pow2scale_cast_to_fp8(data, dtype, log2_scale, nan_on_overflow)``
    (PopXL's float8 options, defaults 0 and True) and float8 host data are kept.

    Raises:
        InvalidArgumentError: ``data`` is a graph tensor, or its dtype (or ``dtype``)
            is not one ipuxl supports (complex, strings...); ``subject`` names the
            variable or constant in the message.
        UnsupportedError: (a RuntimeError) a float8 option for another dtype, or float8 data
            from data that are not float16/32/64.
        InvalidValueError: (a ValueError) with ``keep_memmap``, a memmap that would need converting.
    """
    if isinstance(data, Tensor):
        raise InvalidArgumentError(f"{subject}: cannot initialise from graph tensor '{data.name}'",
                                   where=context.user_source_line(),
                                   fix="pass host data (numpy array, torch tensor or Python number)")
    if keep_memmap:
        check_memmap(data, dtype, subject)  # a memmap is kept as it is, or refused (``ir.memmap``)
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu()
        check_supported(data.dtype, subject)  # before .numpy(), which has its own message
        array = fp8_utils.to_host(data)
    else:
        array = np.asarray(data)
    if dtype is not None:
        target = check_supported(from_any(dtype, subject), subject)
    else:
        inferred = from_any(array.dtype, subject)
        target = DOWNCAST.get(inferred, inferred) if downcast else inferred
    scale, nan_on_overflow = float8_options(subject, target, log2_scale, nan_on_overflow)
    if target in FLOAT8 and array.dtype != to_numpy_dtype(target):
        return fp8_utils.host_pow2scale_cast_to_fp8(array, target, scale, nan_on_overflow), target
    if keep_memmap and isinstance(data, np.memmap) and data.flags.writeable and data.dtype == to_numpy_dtype(target):
        return data, target
    if (given and type(data) is np.ndarray and data.flags.c_contiguous and data.flags.writeable
            and data.dtype == to_numpy_dtype(target)):
        return data, target
    return np.array(array, dtype=to_numpy_dtype(target), copy=True), target


def _record_leaf(node: fx.Node, shape: tuple[int, ...], dtype: torch.dtype, name: str, role: str) -> None:
    node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    node.meta[NAME] = name
    node.meta[ROLE] = role
    node.meta[SOURCE] = context.user_source_line()
    if role == Role.VARIABLE:
        placement.stamp(node)


def _unique_leaf_name(name: str | None, attr: str) -> str:
    """The tensor name of a variable or constant: ``name``, suffixed as its attribute was when the
    name was taken (PopXL's ids are unique: a second "w" is not "w" again)."""
    if name is None:
        return context.scoped_name(attr)
    return context.scoped_name(name + attr[len(_attr_name(name)):])


def _attr_name(name: str) -> str:
    ident = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return ident if ident and not ident[0].isdigit() else f"v_{ident}"
