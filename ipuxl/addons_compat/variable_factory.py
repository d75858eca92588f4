"""Variable factories: a subgraph declares its state, the main graph creates it.

``Module.add_variable_input`` makes a graph input and a ``VariableFactory`` that can
later create a matching variable in the main graph (``NamedVariableFactories.init``),
as popxl.addons does. Variables are created in sorted key order so their initial
data is deterministic.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from ipuxl.addons_compat.dot_tree import DotTree
from ipuxl.addons_compat.named_tensors import NamedTensors
from ipuxl.ir.graph_builder import graph_input, variable
from ipuxl.dtypes import DOWNCAST, DTypeLike, dtype_name, from_any
from ipuxl.errors import GraphContextError, InvalidArgumentError
from ipuxl.ir import context
from ipuxl.ir.tensor import Tensor

__all__ = ["VariableFactory", "NamedVariableFactories", "add_variable_input"]


class VariableFactory:
    """Creates graph inputs and main-graph variables from a data source.

    Args:
        data_iter: a callable returning host data, or an iterable of host data. A
            callable is called once here to test it (the result is discarded, as
            upstream) and then once per variable.
        dtype: the tensor dtype (default: the data's, 64-bit downcast to 32-bit).
        name: the tensor name.
        by_ref: graph inputs made by this factory are passed by reference.
    """

    def __init__(self, data_iter: Callable[[], Any] | Iterable[Any], dtype: DTypeLike = None,
                 name: str | None = None, by_ref: bool = False, replica_grouping: Any = None):
        if callable(data_iter):
            source = data_iter
            try:
                # Upstream calls the callable once to test it and discards the result:
                # doing the same keeps seeded host RNG draws (np.random) identical.
                source()
            except Exception as error:
                raise InvalidArgumentError(
                    f"the data callable of variable factory '{name}' raised {type(error).__name__}: {error}",
                    fix="pass a callable returning host data, e.g. `partial(np.zeros, shape)`") from error

            def endless() -> Iterator[Any]:
                while True:
                    yield source()

            self._data: Iterator[Any] = endless()
        elif isinstance(data_iter, Iterable):
            self._data = iter(data_iter)
        else:
            raise InvalidArgumentError(
                f"VariableFactory needs a callable or an iterable of host data, got {type(data_iter).__name__}",
                fix="wrap fixed data in a function, e.g. `lambda: data`")
        first = np.asarray(_host(next(self._data)))
        self._peeked: list[Any] = [first]
        inferred = from_any(first.dtype)
        self.dtype = from_any(dtype) if dtype is not None else DOWNCAST.get(inferred, inferred)
        self.shape = tuple(first.shape)
        self.name = name
        self.by_ref = by_ref
        self.replica_grouping = replica_grouping

    def next_data(self) -> np.ndarray:
        """The next host value (the first one was read to learn shape and dtype)."""
        return self._peeked.pop() if self._peeked else np.asarray(_host(next(self._data)))

    def create_input(self, prefix: str | None = None) -> Tensor:
        """A graph input of this factory's spec in the current graph."""
        name = self.name if prefix is None else f"{prefix}.{self.name}"
        return graph_input(self.shape, self.dtype, name, by_ref=self.by_ref)

    def create_tensor(self, name: str | None = None) -> Tensor:
        """A variable in the main graph holding the next host value."""
        return variable(self.next_data(), self.dtype, name or self.name)

    def __repr__(self) -> str:
        return f"VariableFactory({self.name!r}, shape={self.shape}, dtype={dtype_name(self.dtype)})"


def _host(data: Any) -> Any:
    return data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else data


class NamedVariableFactories(DotTree[VariableFactory]):
    """A tree of ``VariableFactory``; ``init()`` creates the variables."""

    def init(self, prefix: str | None = None) -> NamedTensors:
        """Create one variable per factory in the main graph, in sorted key order.

        Raises:
            GraphContextError: outside the main graph.
        """
        graph = context.gcg()
        if not graph.is_main:
            raise GraphContextError(
                f"NamedVariableFactories.init() called while building subgraph '{graph.name}': variables "
                "can only be created in the main graph", where=context.user_source_line(),
                fix="call facts.init() under `with ir.main_graph:` and bind or pass the variables to the graph")
        created = {}
        for name, factory in sorted(self.to_dict().items()):
            created[name] = factory.create_tensor(f"{prefix}.{name}" if prefix else name)
        return NamedTensors.from_dict(created)


def add_variable_input(name: str, data_iter: Callable[[], Any] | Iterable[Any], dtype: DTypeLike = None,
                       by_ref: bool = False, replica_grouping: Any = None) -> tuple[Tensor, VariableFactory]:
    """A graph input of the current graph and the factory for its variables."""
    factory = VariableFactory(data_iter, dtype, name, by_ref, replica_grouping)
    return factory.create_input(), factory
