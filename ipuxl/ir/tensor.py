"""Tensor handles: a graph, an fx node, and the spec recorded on the node.

A ``Tensor`` owns no data. Its shape and dtype come from ``node.meta["val"]``, a
meta-device tensor computed when the op was built, so every op's output shape is
known (and checked) at build time. Python operators build ops in the tensor's graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
import torch.fx as fx

from ipuxl import dtypes
from ipuxl.dtypes import dtype_name, from_any
from ipuxl.errors import InvalidArgumentError, InvalidValueError, UndefinedValue
from ipuxl.ir.context import user_source_line
from ipuxl.ir.meta import META_SHAPE, NAME

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir, VariableRecord
    from ipuxl.ir.replica_grouping import ReplicaGrouping

__all__ = ["Tensor", "TensorSpec", "Variable", "Constant", "TensorByRef", "move_handle", "keep_layout"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor, without data (PopXL's ``TensorSpec``).

    Example:
        >>> spec = TensorSpec((2, 3), torch.float32)
        >>> spec.shape
        (2, 3)
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    meta_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", from_any(self.dtype))
        object.__setattr__(self, "meta_shape", tuple(self.meta_shape))

    def to_meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    # PopXL's TensorSpec is a Mapping of shape, dtype and meta_shape: ``graph_input(**spec)`` works.
    def keys(self) -> tuple[str, ...]:
        return ("shape", "dtype", "meta_shape")

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __len__(self) -> int:
        return 3

    def to_dict(self) -> dict[str, Any]:
        """PopXL's ``TensorSpec.to_dict``: shape, dtype (a PopXL dtype) and meta_shape."""
        return {"shape": self.shape, "dtype": dtypes.public(self.dtype), "meta_shape": self.meta_shape}

    def to_tuple(self) -> tuple[tuple[int, ...], Any, tuple[int, ...]]:
        """PopXL's ``TensorSpec.to_tuple``: ``(shape, dtype, meta_shape)``."""
        return self.shape, dtypes.public(self.dtype), self.meta_shape

    def __repr__(self) -> str:
        meta = f", meta_shape={self.meta_shape}" if self.meta_shape else ""
        return f"TensorSpec(shape={self.shape}, dtype={dtype_name(self.dtype)}{meta})"

    def same_data(self, other: "TensorSpec") -> bool:
        """Whether ``other`` has this shape and dtype (the meta shape is a layout annotation, not data)."""
        return (self.shape, self.dtype) == (other.shape, other.dtype)


class Tensor:
    """A value in one graph: the result of an op, a graph input or a variable."""

    __slots__ = ("_graph", "_node", "__weakref__")

    def __init__(self, graph: "Graph", node: fx.Node):
        self._graph = graph
        self._node = node

    # -- identity and spec ------------------------------------------------------
    @property
    def graph(self) -> "Graph":
        return self._graph

    @property
    def node(self) -> fx.Node:
        return self._node

    @property
    def name(self) -> str:
        return self._node.meta.get(NAME, self._node.name)

    @property
    def id(self) -> str:
        """PopXL's id: ``graph_name/tensor_name`` in a subgraph, the name in the main graph
        (whose scope is empty in PopART)."""
        return self.name if self._graph.is_main else f"{self._graph.name}/{self.name}"

    @property
    def _meta(self) -> torch.Tensor:
        return self._node.meta["val"]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._meta.shape)

    @property
    def dtype(self) -> "dtypes.dtype":
        """The PopXL dtype (equal to the torch dtype of the graph's value)."""
        return dtypes.public(self._meta.dtype)

    @property
    def meta_shape(self) -> tuple[int, ...]:
        """The unsharded shape of a replica-sharded tensor; ``()`` otherwise."""
        return tuple(self._node.meta.get(META_SHAPE, ()))

    @property
    def spec(self) -> TensorSpec:
        """Shape, dtype and meta shape (PopXL's ``Tensor.spec``: a sharded tensor's spec keeps its meta shape)."""
        return TensorSpec(self.shape, self._meta.dtype, self.meta_shape)

    @property
    def ir(self) -> "Ir":
        return self._graph.ir

    @property
    def ipu(self) -> int:
        """The IPU the tensor lives on (PopXL's): an op's value is on the IPU it was built on.

        Raises:
            UndefinedValue: the tensor has none: a variable or constant (placed where it is
                read), a graph input, or a value built under ``popxl.ipu(None)``.
        """
        from ipuxl.ir.placement import ipu_of  # placement reads tensors: bind late

        ipu = ipu_of(self._node)
        if ipu is None:
            raise UndefinedValue("Tensor's IPU is undefined.", where=user_source_line(),
                                 fix="read the IPU of an op's result, or build the tensor under popxl.ipu(n)")
        return ipu

    @property
    def tile_set(self) -> str:
        """``"compute"`` or ``"io"``: the tile set of the op that made the tensor (PopXL's).

        Raises:
            UndefinedValue: the tensor is a variable, constant or graph input.
        """
        from ipuxl.ir.placement import tile_set_of  # placement reads tensors: bind late

        tile_set = tile_set_of(self._node)
        if tile_set is None:
            raise UndefinedValue("Tensor's tile set is undefined.", where=user_source_line(),
                                 fix="read the tile set of an op's result")
        return tile_set

    @property
    def scope(self) -> str:
        """The name of the graph the tensor belongs to (PopXL's graph scope of its id)."""
        return self._graph.name

    @property
    def rank(self) -> int:
        return len(self.shape)

    ndim = rank

    @property
    def nelms(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        """The size of axis 0.

        Raises:
            InvalidValueError: (a ValueError, as in PopXL) the tensor is a scalar.
        """
        if not self.shape:
            raise InvalidValueError(f"len() of scalar tensor '{self.name}': a scalar has no axis 0",
                                    where=user_source_line(), fix="use t.shape or t.nelms")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Tensor[{self.id} {self.dtype!r} {self.shape}]"

    def __hash__(self) -> int:
        return id(self)

    def __bool__(self) -> bool:
        raise InvalidArgumentError(
            f"the truth value of tensor '{self.name}' is not known while building a graph",
            where=user_source_line(),
            fix="use ops such as ops.equal or ops.logical_and instead of Python control flow")

    # -- operators build ops ------------------------------------------------------
    def _ensure_tensor(self, value: Any) -> "Tensor":
        """``value`` as a tensor: host data becomes a constant of this tensor's dtype (PopXL's rule).

        Raises:
            InvalidValueError: (a ValueError) the host data has no elements.
        """
        if isinstance(value, Tensor):
            return value
        from ipuxl.ir.graph_builder import constant  # graph_builder imports this module: bind late

        tensor = constant(value, dtype=self._meta.dtype)
        if tensor.nelms == 0:
            raise InvalidValueError(f"operand {value!r} of an operator on tensor '{self.name}' has no elements",
                                    where=user_source_line(), fix="make an empty tensor explicitly if you mean one")
        return tensor

    def _host(self, value: Any) -> Any:
        """Host arrays and sequences become constants of this dtype; Python numbers stay numbers."""
        return self._ensure_tensor(value) if isinstance(value, (np.ndarray, torch.Tensor, list, tuple)) else value

    def __add__(self, other: Any) -> "Tensor":
        return _ops().add(self, self._host(other))

    def __radd__(self, other: Any) -> "Tensor":
        return _ops().add(self._host(other), self)

    def __sub__(self, other: Any) -> "Tensor":
        return _ops().sub(self, self._host(other))

    def __rsub__(self, other: Any) -> "Tensor":
        return _ops().sub(self._host(other), self)

    def __mul__(self, other: Any) -> "Tensor":
        return _ops().mul(self, self._host(other))

    def __rmul__(self, other: Any) -> "Tensor":
        return _ops().mul(self._host(other), self)

    def __truediv__(self, other: Any) -> "Tensor":
        return _ops().div(self, self._host(other))

    def __rtruediv__(self, other: Any) -> "Tensor":
        return _ops().div(self._host(other), self)

    def __matmul__(self, other: Any) -> "Tensor":
        return _ops().matmul(self, self._ensure_tensor(other))

    def __rmatmul__(self, other: Any) -> "Tensor":
        return _ops().matmul(self._ensure_tensor(other), self)

    def __pow__(self, other: Any) -> "Tensor":
        return _ops().pow(self, other)

    def __neg__(self) -> "Tensor":
        return _ops().negate(self)

    def __abs__(self) -> "Tensor":
        return _ops().abs(self)

    def __lt__(self, other: Any) -> "Tensor":
        return _ops().less(self, other)

    def __rpow__(self, other: Any) -> "Tensor":
        return _ops().pow(other, self)

    def __le__(self, other: Any) -> "Tensor":
        # less-or-equal (not "not greater"), so NaN compares False as in torch.
        return _ops().logical_or(_ops().less(self, other), _ops().equal(self, other))

    def __gt__(self, other: Any) -> "Tensor":
        return _ops().greater(self, other)

    def __ge__(self, other: Any) -> "Tensor":
        return _ops().logical_or(_ops().greater(self, other), _ops().equal(self, other))

    def __and__(self, other: Any) -> "Tensor":
        return _ops().logical_and(self, self._host(other))

    def __or__(self, other: Any) -> "Tensor":
        return _ops().logical_or(self, self._host(other))

    def __invert__(self) -> "Tensor":
        return _ops().logical_not(self)

    def __rand__(self, other: Any) -> "Tensor":
        return _ops().logical_and(self._ensure_tensor(other), self)

    def __ror__(self, other: Any) -> "Tensor":
        return _ops().logical_or(self._ensure_tensor(other), self)

    def __mod__(self, other: Any) -> "Tensor":
        """``ops.fmod(self, other)``: the remainder has the sign of ``self``, as in PopXL."""
        return _ops().fmod(self, self._ensure_tensor(other))

    def __rmod__(self, other: Any) -> "Tensor":
        return _ops().fmod(self._ensure_tensor(other), self)

    def __iadd__(self, other: Any) -> "Tensor":
        """``t += x`` adds in place (``ops.add_``), as in PopXL."""
        _ops().add_(self, self._host(other))
        return self

    def __getitem__(self, key: Any) -> "Tensor":
        return _ops().getitem(self, key)

    # No iteration or ``in`` through __getitem__; numpy defers to the reflected operators.
    __iter__ = None
    __contains__ = None
    __array_ufunc__ = None

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        raise UndefinedValue(
            f"tensor '{self.name}' of graph '{self._graph.name}' has no value while the graph is being built",
            where=user_source_line(),
            fix="read it after running: ops.host_store it to a d2h stream, or session.get_tensor_data(t) "
                "for a variable")

    # -- methods ------------------------------------------------------------------
    def reshape(self, shape: Sequence[int]) -> "Tensor":
        return _ops().reshape(self, shape)

    def diag(self) -> "Tensor":
        """The main diagonal of a 2-D tensor, as ``torch.diag`` (PopXL's ``Tensor.diag``).

        Raises:
            InvalidValueError: (a ValueError, as PopXL) the tensor is not 2-D.
        """
        if self.rank != 2:
            raise InvalidValueError(f"diag of tensor '{self.name}' {self.shape}: only 2-D tensors have a diagonal "
                                    "here", where=user_source_line(), fix="reshape the tensor to 2-D first")
        from ipuxl.ops.shape import diagonal  # ops build on this module: bind late

        return diagonal(self)

    def flatten(self) -> "Tensor":
        return _ops().flatten(self)

    def copy_to_ipu(self, destination: int, source: int | None = None) -> "Tensor":
        """A copy of this tensor on IPU ``destination`` (``ops.ipu_copy``)."""
        return _ops().ipu_copy(self, destination, source)

    def transpose(self, permutation: Sequence[int] | None = None) -> "Tensor":
        return _ops().transpose(self, permutation)

    @property
    def T(self) -> "Tensor":  # noqa: N802 - PopXL's public name
        return _ops().transpose(self)

    @property
    def T_(self) -> "Tensor":  # noqa: N802 - PopXL's public name
        """The tensor with its axes reversed, in place (``ops.transpose_``)."""
        return _ops().transpose_(self)

    def reshape_(self, shape: Sequence[int]) -> "Tensor":
        return _ops().reshape_(self, shape)

    def flatten_(self) -> "Tensor":
        return _ops().flatten_(self)

    def transpose_(self, permutation: Sequence[int] | None = None) -> "Tensor":
        return _ops().transpose_(self, permutation)

    def detach(self) -> "Tensor":
        return _ops().detach(self)

    def detach_(self) -> "Tensor":
        return _ops().detach_(self)

    def strides(self, shape: Sequence[int] | None = None) -> tuple[int, ...]:
        """Bytes to step in each dimension of a contiguous tensor of ``shape`` (default: its own)."""
        shape = tuple(self.shape if shape is None else shape)
        step, out = self.dtype.itemsize, []
        for dim in reversed(shape):
            out.append(step)
            step *= dim
        return tuple(reversed(out))


class Variable(Tensor):
    """A tensor of the main graph whose storage the device owns across runs."""

    __slots__ = ()

    @property
    def is_variable(self) -> bool:
        return True

    @property
    def replica_grouping(self) -> "ReplicaGrouping":
        """The grouping of replicas that share this variable's value (one group by default)."""
        return self._record.replica_grouping(self.ir.replication_factor)

    @property
    def retrieval_mode(self) -> str:
        """``"one_per_group"`` or ``"all_replicas"``: what ``Session.get_tensor_data`` returns."""
        return self._record.retrieval_mode

    @property
    def shape_on_replica(self) -> tuple[int, ...]:
        """The shape each replica holds (``shape``)."""
        return self.shape

    @property
    def shape_on_host(self) -> tuple[int, ...]:
        """The shape of the host data: ``(num_groups, *shape)`` when several groups hold values."""
        groups = self.replica_grouping.num_groups
        return (groups, *self.shape) if groups > 1 else self.shape

    @property
    def _record(self) -> "VariableRecord":
        return self.ir.variable_records[str(self._node.target)]

    @property
    def _memmap_arr(self) -> np.ndarray | None:
        """The ``np.memmap`` the variable was made from, which is its host buffer
        (``ir.memmap``); None when its data was copied (PopXL's private attribute, which
        popxl.addons' memmapped ``init`` reads)."""
        data = self._record.data
        return data if isinstance(data, np.memmap) else None


class Constant(Tensor):
    """A tensor whose value is fixed when the graph is built."""

    __slots__ = ()

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        """The constant's value (``np.asarray(c)``); bfloat16 data reads as float32."""
        data = self._graph.constant_data[str(self._node.target)]
        array = (data.float() if data.dtype == torch.bfloat16 else data).numpy().copy()
        return array if dtype is None else array.astype(dtype)


class TensorByRef:
    """Marks a subgraph input as passed by reference: in-place changes reach the caller.

    As in PopXL, annotate the parameter (``def fn(w: TensorByRef)``); ipuxl also
    accepts wrapping the argument: ``ir.create_graph(fn, TensorByRef(tensor_or_spec))``.
    """

    __slots__ = ("value",)

    def __init__(self, value: "Tensor | TensorSpec"):
        self.value = value


def move_handle(tensor: Tensor, node: fx.Node) -> None:
    """Make ``tensor`` stand for ``node`` of the same graph.

    Only ``Graph`` calls this, when a pass replaces the node a handle stood for
    (``Graph.replace_body``); everywhere else a handle's node never changes.
    """
    tensor._node = node


def keep_layout(node: fx.Node, value: torch.Tensor) -> None:
    """Give graph input ``node`` the strides of the traced ``value`` (inputs are otherwise made
    contiguous from their spec): the graph is then traced, and called, in the layout its values
    have where it runs, so views traced on them stay valid and calls copy nothing."""
    node.meta["val"] = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype,
                                           device="meta")


def _ops() -> Any:
    # Tensor operators build ops; the ops package imports this module, so bind late.
    import ipuxl.ops as ops

    return ops
