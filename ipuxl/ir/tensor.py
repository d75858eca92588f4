"""Tensor handles: a graph, an fx node, and the spec recorded on the node.

A ``Tensor`` owns no data. Its shape and dtype come from ``node.meta["val"]``, a
meta-device tensor computed when the op was built, so every op's output shape is
known (and checked) at build time. Python operators build ops in the tensor's graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.fx as fx

from ipuxl.dtypes import dtype_name, from_any
from ipuxl.ir.meta import NAME

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph

__all__ = ["Tensor", "TensorSpec", "Variable", "Constant", "TensorByRef", "move_handle"]


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

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={dtype_name(self.dtype)})"


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
        """Graph-scoped id, PopXL style: ``graph_name/tensor_name``."""
        return f"{self._graph.name}/{self.name}"

    @property
    def _meta(self) -> torch.Tensor:
        return self._node.meta["val"]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._meta.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._meta.dtype

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self.dtype)

    @property
    def rank(self) -> int:
        return len(self.shape)

    ndim = rank

    @property
    def nelms(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of a scalar tensor '{self.name}'")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Tensor[{self.id} {dtype_name(self.dtype)} {self.shape}]"

    def __hash__(self) -> int:
        return id(self)

    def __bool__(self) -> bool:
        raise TypeError(
            f"the truth value of tensor '{self.name}' is not known while building a graph; "
            "use ops such as ops.equal or ops.logical_and instead of Python control flow"
        )

    # -- operators build ops ------------------------------------------------------
    def __add__(self, other: Any) -> "Tensor":
        return _ops().add(self, other)

    def __radd__(self, other: Any) -> "Tensor":
        return _ops().add(other, self)

    def __sub__(self, other: Any) -> "Tensor":
        return _ops().sub(self, other)

    def __rsub__(self, other: Any) -> "Tensor":
        return _ops().sub(other, self)

    def __mul__(self, other: Any) -> "Tensor":
        return _ops().mul(self, other)

    def __rmul__(self, other: Any) -> "Tensor":
        return _ops().mul(other, self)

    def __truediv__(self, other: Any) -> "Tensor":
        return _ops().div(self, other)

    def __rtruediv__(self, other: Any) -> "Tensor":
        return _ops().div(other, self)

    def __matmul__(self, other: Any) -> "Tensor":
        return _ops().matmul(self, other)

    def __rmatmul__(self, other: Any) -> "Tensor":
        return _ops().matmul(other, self)

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
        return _ops().logical_and(self, other)

    def __or__(self, other: Any) -> "Tensor":
        return _ops().logical_or(self, other)

    def __invert__(self) -> "Tensor":
        return _ops().logical_not(self)

    def __getitem__(self, key: Any) -> "Tensor":
        return _ops().getitem(self, key)

    # -- methods ------------------------------------------------------------------
    def reshape(self, shape: Sequence[int]) -> "Tensor":
        return _ops().reshape(self, shape)

    def flatten(self) -> "Tensor":
        return _ops().flatten(self)

    def transpose(self, permutation: Sequence[int] | None = None) -> "Tensor":
        return _ops().transpose(self, permutation)

    @property
    def T(self) -> "Tensor":  # noqa: N802 - PopXL's public name
        return _ops().transpose(self)

    def detach(self) -> "Tensor":
        return _ops().detach(self)

    def copy_to_ipu(self, *args: Any) -> "Tensor":
        """Single-IPU programs: the tensor is already where it is needed."""
        return self


class Variable(Tensor):
    """A tensor of the main graph whose storage the device owns across runs."""

    __slots__ = ()

    @property
    def is_variable(self) -> bool:
        return True


class Constant(Tensor):
    """A tensor whose value is fixed when the graph is built."""

    __slots__ = ()


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


def _ops() -> Any:
    # Tensor operators build ops; the ops package imports this module, so bind late.
    import ipuxl.ops as ops

    return ops
