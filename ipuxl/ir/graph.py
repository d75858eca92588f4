"""``Graph``: one torch.fx Graph plus PopXL's notion of inputs and outputs.

The fx graph holds the ops in build order (the program order every pass keeps).
Inputs are its placeholders; outputs are kept as a list and become the fx output
node only when the graph is compiled, so ops can still be appended after outputs
are set.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.fx as fx

from ipuxl.ir import context
from ipuxl.ir.tensor import Tensor, TensorSpec

if TYPE_CHECKING:
    from ipuxl.ir.ir import Ir

__all__ = ["Graph"]


class Graph:
    """A PopXL graph: the main program or a subgraph called with ``ops.call``.

    Attributes:
        ir: the IR that owns the graph.
        name: unique name within the IR (``Linear_subgraph(0)``, as PopXL names them).
        base_name: the name it was created from (``Linear``).
        fx: the underlying ``torch.fx.Graph`` (ops in program order).
    """

    def __init__(self, ir: "Ir", name: str, base_name: str | None = None):
        self.ir = ir
        self.name = name
        self.base_name = base_name or name
        self.fx = fx.Graph()
        self._inputs: list[Tensor] = []
        self._outputs: list[Tensor] = []
        self._handles: dict[fx.Node, Tensor] = {}
        self.constants: dict[str, torch.Tensor] = {}
        # (grad graph, expected inputs, required inputs) once autodiff differentiated it
        self._ipuxl_grad: tuple | None = None

    # -- context ------------------------------------------------------------------
    def __enter__(self) -> "Graph":
        context.push_graph(self)
        return self

    def __exit__(self, *exc: object) -> None:
        context.pop_graph(self)

    # -- inputs and outputs -------------------------------------------------------------
    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(self._inputs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(self._outputs)

    def get_input_tensors(self) -> tuple[Tensor, ...]:
        return self.inputs

    def get_output_tensors(self) -> tuple[Tensor, ...]:
        return self.outputs

    @property
    def is_main(self) -> bool:
        return self is self.ir.main_graph

    def add_input(self, spec: TensorSpec, name: str, *, by_ref: bool = False,
                   role: str = "input") -> Tensor:
        """Append a graph input (an fx placeholder after the existing ones)."""
        node = self._insert_placeholder(name)
        node.meta["val"] = spec.to_meta()
        node.meta["ipuxl_name"] = name
        node.meta["ipuxl_role"] = role
        node.meta["ipuxl_by_ref"] = by_ref
        tensor = self.wrap(node)
        if role == "input":
            self._inputs.append(tensor)
        return tensor

    def _insert_placeholder(self, name: str) -> fx.Node:
        placeholders = []  # they lead the graph: stop at the first op
        for n in self.fx.nodes:
            if n.op != "placeholder":
                break
            placeholders.append(n)
        # The target is the generated function's argument name: it must be unique.
        taken = {n.target for n in placeholders}
        base = identifier(name)
        target, i = base, 1
        while target in taken:
            target, i = f"{base}_{i}", i + 1
        anchor = placeholders[-1].next if placeholders else next(iter(self.fx.nodes), None)
        if anchor is None or anchor.op == "root":
            return self.fx.placeholder(target)
        with self.fx.inserting_before(anchor):
            return self.fx.placeholder(target)

    def set_outputs(self, outputs: Iterable[Tensor]) -> None:
        self._outputs = list(outputs)

    def add_output(self, tensor: Tensor) -> int:
        self._outputs.append(tensor)
        return len(self._outputs) - 1

    def wrap(self, node: fx.Node, cls: type[Tensor] = Tensor) -> Tensor:
        """The unique Tensor handle of ``node`` (created on first use)."""
        handle = self._handles.get(node)
        if handle is None:
            handle = cls(self, node)
            self._handles[node] = handle
        return handle

    def is_input_modified(self, tensor: Tensor) -> bool:
        """True when an in-place op of this graph writes to input ``tensor``."""
        return any(tensor.node in n.meta.get("ipuxl_writes", ()) for n in self.fx.nodes)

    # -- inspection ----------------------------------------------------------------------
    def print_schedule(self) -> str:
        """Return the graph's ops in schedule order, in PopXL's text form."""
        from ipuxl.ir.printer import format_schedule

        return format_schedule(self)

    def __repr__(self) -> str:
        return f"Graph[{self.name}: {len(self._inputs)} inputs, {len(self._outputs)} outputs]"


def identifier(name: str) -> str:
    """A valid Python identifier derived from a user's tensor name."""
    ident = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "t"
    return ident if not ident[0].isdigit() else f"t_{ident}"


def describe(value: Any) -> str:
    """Short description of a value for error messages."""
    if isinstance(value, Tensor):
        return f"'{value.name}' {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return repr(value)
