"""``Graph``: one torch.fx Graph plus PopXL's notion of inputs and outputs.

The fx graph holds the ops in build order (the program order every pass keeps).
Inputs are its placeholders; outputs are kept as a list and become the fx output
node only when the graph is compiled, so ops can still be appended after outputs
are set.

Each node has at most one ``Tensor`` handle (``Graph.wrap``); users and passes hold
handles, so a pass that replaces nodes moves their handles with it
(``Graph.replace_body`` / ``Graph.rebuild``) instead of editing them.
"""
from __future__ import annotations

import contextlib
import itertools
import types
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, TypeVar, overload

import torch
import torch.fx as fx

from ipuxl.dtypes import dtype_name
from ipuxl.errors import GraphContextError, InvalidArgumentError, InvalidValueError, PassError
from ipuxl.ir import context
from ipuxl.ir.aliases import is_written
from ipuxl.ir.meta import BY_REF, META_SHAPE, NAME, ROLE, Role
from ipuxl.ir.printer import format_schedule
from ipuxl.ir.tensor import Constant, Tensor, TensorSpec, Variable, move_handle

if TYPE_CHECKING:
    from ipuxl.ir.grad_info import GradGraphInfo
    from ipuxl.ir.ir import Ir

__all__ = ["Graph", "identifier", "describe"]

T = TypeVar("T", bound=Tensor)
OpCreatedHook = Callable[[fx.Node], Any]
_hook_handles = itertools.count(1)  # PopXL numbers hook handles across graphs


class Graph:
    """A PopXL graph: the main program or a subgraph called with ``ops.call``.

    Attributes:
        ir: the IR that owns the graph.
        name: unique name within the IR (``Linear_subgraph(0)``, as PopXL names them).
        base_name: the name it was created from (``Linear``).
        fx: the underlying ``torch.fx.Graph`` (ops in program order).
        constant_data: the data of the graph's constants, by ``get_attr`` target.
        grad_info: what autodiff recorded when it differentiated this graph, else None.
    """

    def __init__(self, ir: "Ir", name: str, base_name: str | None = None):
        self.ir = ir
        self.name = name
        self.base_name = base_name or name
        self.fx = fx.Graph()
        self._inputs: list[Tensor] = []
        self._outputs: list[Tensor] = []
        self._handles: dict[fx.Node, Tensor] = {}
        self.constant_data: dict[str, torch.Tensor] = {}
        self.grad_info: GradGraphInfo | None = None
        self.can_be_recursively_autodiffed = True
        """False for a graph whose gradient is written by hand (a popxl.addons Module's
        ``build_grad``): autodiff of a graph calling it needs its ``GradGraphInfo``."""
        self._op_created_hooks: dict[int, OpCreatedHook] = {}

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

    @property
    def _by_ref_inputs(self) -> set[Tensor]:
        """The inputs passed by reference (PopXL's ``Graph._by_ref_inputs``): ``TensorByRef``
        parameters and ``graph_input(..., by_ref=True)``. A new set on each read."""
        return {t for t in self._inputs if t.node.meta.get(BY_REF)}

    def get_input_tensors(self) -> tuple[Tensor, ...]:
        return self.inputs

    def get_output_tensors(self) -> tuple[Tensor, ...]:
        return self.outputs

    @property
    def inputs_by_name(self) -> dict[str, Tensor]:
        return {t.name: t for t in self._inputs}

    @property
    def is_main(self) -> bool:
        return self is self.ir.main_graph

    @property
    def id(self) -> str:
        """PopXL's graph id; in ipuxl the graph's unique name."""
        return self.name

    @property
    def main_graph(self) -> "Graph":
        return self.ir.main_graph

    # -- the graph's tensors (PopXL's Graph.tensors / variables / constants) ------------
    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor of the graph, in program order: inputs, variables, constants, op results."""
        return tuple(self._tensor(n) for n in self.fx.nodes if isinstance(n.meta.get("val"), torch.Tensor))

    @property
    def variables(self) -> tuple[Variable, ...]:
        """The variables of the graph (only the main graph has any)."""
        return tuple(t for t in self.tensors if isinstance(t, Variable))

    @property
    def constants(self) -> tuple[Constant, ...]:
        """The graph's constants (their data: ``constant_data``, by ``get_attr`` target)."""
        return tuple(t for t in self.tensors if isinstance(t, Constant))

    @property
    def _ir(self) -> "Ir":
        """The graph's IR under PopXL's attribute name (``graph._ir``), which programs read."""
        return self.ir

    @property
    def called_graphs(self) -> list["Graph"]:
        """The graphs this graph calls directly (``ops.call``, ``ops.repeat``), each once (PopXL's)."""
        from ipuxl.ir.calls import called_graphs  # calls reads graphs: bind late

        return called_graphs(self)

    def get_tensor(self, tensor_id: str) -> Tensor:
        """The tensor whose ``id`` or name is ``tensor_id`` (``graph/name`` is accepted for the
        main graph's tensors too, whose PopXL ids are their names).

        Raises:
            InvalidValueError: (a ValueError) no tensor of this graph has it.
        """
        for t in self.tensors:
            if tensor_id in (t.id, t.name, f"{self.name}/{t.name}"):
                return t
        looks = "<tensor name>" if self.is_main else f"{self.name}/<tensor name>"
        raise InvalidValueError(f"graph '{self.name}' has no tensor with id {tensor_id!r}",
                                where=context.user_source_line(),
                                fix=f"ids of this graph look like '{looks}'; see graph.tensors")

    def __contains__(self, value: Tensor) -> bool:
        if not isinstance(value, Tensor):
            raise InvalidArgumentError(f"`in graph` needs a Tensor, got {type(value).__name__}",
                                       where=context.user_source_line())
        return value.graph is self and value.node.graph is self.fx

    def _tensor(self, node: fx.Node) -> Tensor:
        role = node.meta.get(ROLE)
        cls = Variable if role == Role.VARIABLE else Constant if role == Role.CONSTANT else Tensor
        return self.wrap(node, cls)

    # -- op-created hooks ---------------------------------------------------------------
    def register_op_created_hook(self, fn: OpCreatedHook) -> int:
        """Call ``fn(node)`` after each op is built in this graph; returns a handle.

        Differs from PopXL: ``fn`` receives the op's ``torch.fx.Node`` (its PopXL name is
        ``node.meta[ipuxl.ir.meta.OP]``), not a PopART op.
        """
        handle = next(_hook_handles)
        self._op_created_hooks[handle] = fn
        return handle

    def remove_op_created_hook(self, handle: int) -> None:
        """Remove a hook added by ``register_op_created_hook``.

        Raises:
            InvalidValueError: (a ValueError) ``handle`` is not a hook of this graph.
        """
        if self._op_created_hooks.pop(handle, None) is None:
            raise InvalidValueError(f"unknown op created hook {handle!r} for graph '{self.name}'",
                                    where=context.user_source_line(),
                                    fix="pass the handle register_op_created_hook returned, once")

    def op_created(self, node: fx.Node) -> None:
        """Run the op-created hooks on ``node``, an op just built into this graph."""
        for fn in tuple(self._op_created_hooks.values()):
            fn(node)

    def add_input(self, spec: TensorSpec, name: str, *, by_ref: bool = False, role: str = Role.INPUT) -> Tensor:
        """Append a placeholder after the existing ones; a graph input when ``role`` is ``Role.INPUT``.

        Other roles (host-stream slots, a module's seed) are placeholders the device
        fills itself: they are not in ``inputs``.
        """
        node = self._insert_placeholder(name)
        node.meta["val"] = spec.to_meta()
        node.meta[NAME] = name
        node.meta[ROLE] = role
        node.meta[BY_REF] = by_ref
        if spec.meta_shape:
            node.meta[META_SHAPE] = spec.meta_shape
        tensor = self.wrap(node)
        if role == Role.INPUT:
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
        """Make ``outputs`` (tensors of this graph) the graph's outputs, in order."""
        self._outputs = list(outputs)

    def add_output(self, tensor: Tensor) -> int:
        """Append ``tensor`` to the outputs; returns its index."""
        self._outputs.append(tensor)
        return len(self._outputs) - 1

    # -- handles ------------------------------------------------------------------------
    @overload
    def wrap(self, node: fx.Node) -> Tensor: ...

    @overload
    def wrap(self, node: fx.Node, cls: type[T]) -> T: ...

    def wrap(self, node: fx.Node, cls: type[Tensor] = Tensor) -> Tensor:
        """The unique Tensor handle of ``node`` (created on first use, of class ``cls``)."""
        handle = self._handles.get(node)
        if handle is None:
            handle = cls(self, node)
            self._handles[node] = handle
        return handle

    def handle(self, node: fx.Node) -> Tensor | None:
        """The Tensor handle of ``node`` if one was made, else None (makes none)."""
        return self._handles.get(node)

    def handles(self) -> Mapping[fx.Node, Tensor]:
        """Every handle made so far, by node (a read-only view)."""
        return types.MappingProxyType(self._handles)

    def replace_body(self, new_fx: fx.Graph, node_map: Mapping[fx.Node, fx.Node]) -> None:
        """Make ``new_fx`` this graph's body; handles follow ``node_map`` (old node -> new node).

        For a pass that rebuilt the graph. Every handle of a mapped node now stands for
        its new node, so the graph's inputs and outputs, and tensors users hold, stay
        valid. Where the new node already has a handle, the moved one replaces it
        (outputs naming the replaced handle name the moved one); where two old nodes
        map to one new node, the first one's handle is kept for both. Handles of nodes
        still in ``new_fx`` stay; the rest are dropped. ``new_fx`` may be ``self.fx``
        (a pass that edited the body in place: map each replaced node to its
        replacement, and erase the replaced nodes first).

        Raises:
            PassError: an input or output is left without a node in ``new_fx``.
        """
        with self.rebuild(new_fx, dict(node_map)):
            pass

    @contextlib.contextmanager
    def rebuild(self, new_fx: fx.Graph, node_map: dict[fx.Node, fx.Node]) -> Iterator["Graph"]:
        """Build a replacement body with ops, then swap it in (as ``replace_body``).

        On entry ``new_fx``, which holds the new placeholders, becomes ``self.fx`` (ops
        built under ``with graph:`` go into it) and the inputs' handles follow the
        placeholders mapped in ``node_map`` at once. The block adds the other old nodes
        whose handles must survive (the outputs at least) to ``node_map``; on exit they
        follow. A block that raises leaves the graph half rebuilt.

        Example (``y = f(x)`` becomes ``y = log(x)``; ``x`` and ``y`` stay valid):
            >>> new = torch.fx.Graph()
            >>> node_map = {x.node: new.placeholder(x.node.target)}
            >>> node_map[x.node].meta.update(x.node.meta)
            >>> old_y = y.node
            >>> with graph.rebuild(new, node_map), graph:
            ...     node_map[old_y] = ops.log(x).node
        """
        alive = set(new_fx.nodes)
        pending = {n: h for n, h in self._handles.items() if n not in alive or n in node_map}
        self._handles = {n: h for n, h in self._handles.items() if n not in pending}
        self.fx = new_fx
        moved: dict[fx.Node, Tensor] = {}
        self._move_handles(pending, {old: new for old, new in node_map.items() if old.op == "placeholder"}, moved)
        yield self
        self._move_handles(pending, node_map, moved)
        self._check_io_kept(set(pending.values()))

    def _move_handles(self, pending: dict[fx.Node, Tensor], node_map: Mapping[fx.Node, fx.Node],
                      moved: dict[fx.Node, Tensor]) -> None:
        """Move the handles of ``pending`` nodes in ``node_map`` to their new nodes."""
        for old, new in node_map.items():
            handle = pending.pop(old, None)
            if handle is None:
                continue
            if new in moved:  # an earlier old node took it: keep that handle for both
                self._redirect(handle, moved[new])
                continue
            displaced = self._handles.get(new)
            move_handle(handle, new)
            self._handles[new] = moved[new] = handle
            if displaced is not None:
                self._redirect(displaced, handle)

    def _redirect(self, old: Tensor, new: Tensor) -> None:
        """Inputs and outputs that name handle ``old`` name ``new`` instead."""
        self._inputs = [new if t is old else t for t in self._inputs]
        self._outputs = [new if t is old else t for t in self._outputs]

    def _check_io_kept(self, dropped: set[Tensor]) -> None:
        for kind, tensors in (("input", self._inputs), ("output", self._outputs)):
            lost = [t.name for t in tensors if t in dropped]
            if lost:
                raise PassError(f"graph '{self.name}' was given a new body without the node of {kind}(s) {lost}",
                                fix="map every input and output node to its replacement in node_map")

    def is_input_modified(self, tensor: Tensor) -> bool:
        """True when an in-place op of this graph writes to input ``tensor``."""
        return is_written(self, tensor.node)

    # -- inspection ----------------------------------------------------------------------
    def print_schedule(self) -> str:
        """Return the graph's ops in schedule order, in PopXL's text form."""
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
        return f"'{value.name}' {tuple(value.shape)} {dtype_name(value.dtype)}"
    return repr(value)
