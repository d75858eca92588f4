"""The build context: which graph ops go into, and whether they run in sequence.

PopXL builds ops into "the current graph" (``with ir.main_graph:``), so a small
explicit stack is part of the programming model. It lives here, in one place, and
is always restored by context managers, never reset by hand.
"""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from ipuxl.errors import GraphContextError, InvalidArgumentError
from ipuxl.source import is_user_file, user_source_line

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.ir import Ir
    from ipuxl.ir.replica_grouping import ReplicaGrouping

__all__ = ["gcg", "get_current_graph", "gmg", "get_main_graph", "gir", "get_ir", "in_sequence", "name_scope",
           "scoped_name", "user_source_line", "replica_grouping", "traceback_source_line"]

_graph_stack: list["Graph"] = []
_sequence_stack: list[bool] = []
_name_scopes: list[str] = []
F = TypeVar("F", bound=Callable)


def gcg() -> "Graph":
    """Return the graph that ops are currently built into.

    Raises:
        GraphContextError: if no graph context is open.
    """
    if not _graph_stack:
        raise GraphContextError(
            "no graph is being built: ops, variables and streams need a graph context",
            where=user_source_line(),
            fix="build inside `with ir.main_graph:` or inside a function passed to ir.create_graph",
        )
    return _graph_stack[-1]


get_current_graph = gcg


def get_main_graph() -> "Graph":
    """The main graph of the IR whose graph is being built (PopXL's ``gmg``).

    Raises:
        GraphContextError: (a RuntimeError) if no graph context is open.
    """
    if not _graph_stack:
        raise GraphContextError(
            "no graph is being built, so there is no main graph to return",
            where=user_source_line(),
            fix="call it inside `with ir.main_graph:` (or any graph of the IR), or use ir.main_graph")
    return _graph_stack[0].ir.main_graph


gmg = get_main_graph


def get_ir() -> "Ir":
    """The IR of the graph being built (ipuxl's shorthand for ``gcg().ir``)."""
    return gcg().ir


gir = get_ir


@contextlib.contextmanager
def name_scope(name: str) -> Iterator[list[str]]:
    """Prefix the names of tensors built in this context with ``name/`` (PopXL's ``name_scope``).

    Scopes nest (``outer/inner/x``); yields the open scopes, outermost first.
    """
    _name_scopes.append(str(name))
    try:
        yield list(_name_scopes)
    finally:
        _name_scopes.pop()


def scoped_name(name: str) -> str:
    """``name`` under the open name scopes (``"outer/inner/name"``), or ``name`` itself."""
    return "/".join((*_name_scopes, name)) if _name_scopes else name


def name_scopes_open() -> bool:
    return bool(_name_scopes)


def push_graph(graph: "Graph") -> None:
    if _graph_stack and _graph_stack[-1].ir is not graph.ir:
        raise GraphContextError(
            f"Cannot enter graph '{graph.name}' of another Ir inside the context of graph '{_graph_stack[-1].name}' "
            "(PopXL allows only graphs of one Ir in nested contexts)", where=user_source_line(),
            fix="leave the other Ir's graph context first")
    _graph_stack.append(graph)


def pop_graph(graph: "Graph") -> None:
    assert _graph_stack and _graph_stack[-1] is graph, "graph contexts must nest"
    _graph_stack.pop()


def in_sequence_enabled() -> bool:
    return bool(_sequence_stack) and _sequence_stack[-1]


class in_sequence:  # noqa: N801 - PopXL's public name
    """Force ops to run in the order they are built (context manager or decorator).

    ipuxl always executes a graph's ops in build order, so this never changes results
    here; it records the constraint on each op (``node.meta[ipuxl.ir.meta.IN_SEQUENCE]``)
    so that passes which reorder ops must keep it, as in PopXL.
    """

    def __init__(self, enabled: bool = True):
        if enabled is None:
            raise InvalidArgumentError("`None` cannot be passed to in_sequence: it is not a setting", where=user_source_line(),
                                       fix="use in_sequence(False) to let ops run in any order")
        self.enabled = enabled

    def __enter__(self) -> "in_sequence":
        _sequence_stack.append(self.enabled)
        return self

    def __exit__(self, *exc: object) -> None:
        _sequence_stack.pop()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with in_sequence(self.enabled):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def traceback_source_line(tb: Any) -> str | None:
    """``file:line in function`` of the innermost user frame of a traceback (an
    exception raised while tracing a user's module: the line of their ``forward``)."""
    found = None
    while tb is not None:
        if is_user_file(tb.tb_frame.f_code.co_filename):  # installed libraries' files count (transformers)
            found = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return found


def replica_grouping(stride: int = 1, group_size: int | None = None) -> "ReplicaGrouping":
    """``ir.replica_grouping(stride, group_size)`` of the current graph's IR."""
    return gcg().ir.replica_grouping(stride, group_size)
