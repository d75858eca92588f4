"""Import the body of a make_fx (aten-level) GraphModule into an IR graph.

Used by ``transforms.autodiff`` (the partitioned forward and backward) and by module
capture (``capture.to_ir``): each node is copied with a meta tensor value, a fresh op
id and, for aten ops that return a view of their input, the ``VIEW_OF`` record
(``ipuxl.ir.meta``) that lowering needs to keep PopXL's value semantics. ``ipuxl::call_graph`` nodes (calls
of shared graphs recorded while tracing, see ``ir.call_op``) become IR calls.

Each copied op also gets ``meta[SOURCE]``, the user's ``file:line in function``
that made it (what errors quote), from one of two places:

* a module trace records each node's user ``forward`` frame as its stack trace
  (``capture.node_sources``): the innermost frame outside ipuxl, torch and the
  standard library is the user's line;
* a trace of an IR graph's own body that then replaces it (``autodiff`` importing the
  partitioned forward of the graph it traced) knows no user frames: each op takes
  the source of the op of the replaced body that computes the same thing (same aten
  op of the corresponding inputs; copies made by lowering are seen through).
"""
from __future__ import annotations

import operator
import re
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.fx as fx

from ipuxl.ir.call_op import call_entry, is_call_graph_node
from ipuxl.ir.calls import CallTarget
from ipuxl.ir.copy import copy_node
from ipuxl.ir.meta import CALLED_GRAPH, IPU, NAME, OP, OP_ID, PIPELINE_STAGE, SOURCE, VIEW_OF
from ipuxl.source import is_user_file

if TYPE_CHECKING:
    from ipuxl.ir.ir import Ir

__all__ = ["copy_fx_body", "to_meta", "returns_view"]


def copy_fx_body(source: fx.GraphModule, new: fx.Graph, env: dict[fx.Node, fx.Node],
                 constants: dict[str, torch.Tensor], ir: "Ir", *, replaces: fx.Graph | None = None) -> None:
    """Copy every op of ``source`` into ``new``; ``env`` maps source nodes (placeholders
    already bound) to new nodes and is filled in; constants land in ``constants``.
    ``replaces``: the body ``new`` replaces (a trace of it), whose ops lend their sources."""
    calls: dict[fx.Node, Any] = {}
    lines = _UserLines()
    replaced = _ReplacedBody.of(replaces, env) if replaces is not None else None
    for node in source.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_call_graph_node(node):
            env[node] = calls[node] = _import_call(node, new, env, ir)
            line = replaced.source_of(node) if replaced is not None else None
            if line:
                calls[node].meta[SOURCE] = line
            if replaced is not None:
                calls[node].meta.update(replaced.placement_of(node))
            continue
        copied = copy_node(node, new, env)
        # the stack trace is only read here: kept, fx would print it into every generated program
        line = lines.innermost(copied.meta.pop("stack_trace", None))
        if line is None and replaced is not None:
            line = replaced.source_of(node)
        if line and node.op == "call_function":
            copied.meta[SOURCE] = line
        if replaced is not None and node.op != "placeholder":
            copied.meta.update(replaced.placement_of(node))
        if node.target is operator.getitem and node.args[0] in calls:
            out = calls[cast(fx.Node, node.args[0])].meta[CALLED_GRAPH].outputs[cast(int, node.args[1])]
            copied.meta.update({OP: "output_of", NAME: out.name})
        copied.meta["val"] = to_meta(node.meta.get("val"))
        if node.op == "call_function" and node.target is not operator.getitem:
            copied.meta[OP_ID] = ir.next_op_id()
        if returns_view(node.target) and copied.all_input_nodes:
            copied.meta[VIEW_OF] = copied.all_input_nodes[0]
        if node.op == "get_attr":
            constants[node.target] = getattr(source, node.target)
        env[node] = copied


def _import_call(node: fx.Node, new: fx.Graph, env: dict[fx.Node, fx.Node], ir: "Ir") -> fx.Node:
    """An IR call of the graph behind an ``ipuxl::call_graph`` node."""
    key, args = _call_graph_args(node)
    graph = call_entry(key).graph
    target = CallTarget(graph)
    call = new.create_node("call_function", target, tuple(env[a] for a in args), {}, name=target.__name__)
    call.meta.update({"val": to_meta(tuple(node.meta["val"])), OP: "call", CALLED_GRAPH: graph,
                      OP_ID: ir.next_op_id()})
    return call


def _call_graph_args(node: fx.Node) -> tuple[int, list[fx.Node]]:
    """The call key and the argument nodes of an ``ipuxl::call_graph`` node."""
    key, args = node.args
    return cast(int, key), list(cast(list, args))


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


class _UserLines:
    """The user's line in make_fx stack traces (cached: the ops of one line share a trace)."""

    def __init__(self) -> None:
        self._cache: dict[str, str | None] = {}

    def innermost(self, stack_trace: str | None) -> str | None:
        """``file:line in function`` of the innermost frame outside ipuxl, torch and the stdlib."""
        if not stack_trace:
            return None
        if stack_trace not in self._cache:
            found = None
            for filename, line, function in _FRAME.findall(stack_trace):
                if is_user_file(filename):
                    found = f"{filename}:{line} in {function}"
            self._cache[stack_trace] = found
        return self._cache[stack_trace]


class _NoMatch(Exception):
    """An argument has no counterpart in the replaced body."""


# ops that lowering inserts (value copies) or that tracing adds around values: seen through
_SEE_THROUGH = {torch.ops.aten.clone.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class _ReplacedBody:
    """The body of the IR graph that ``new`` replaces, to give re-traced ops their sources.

    Matching is structural: a traced op corresponds to the op of the replaced body with
    the same target and corresponding arguments (inputs by name, then op by op).
    """

    def __init__(self, old: fx.Graph, env: dict[fx.Node, fx.Node]):
        self._env = env
        self._placeholders = {n.name: n for n in old.nodes if n.op == "placeholder"}
        self._attrs = {n.target: n for n in old.nodes if n.op == "get_attr"}
        self._index: dict[Any, fx.Node] = {}
        self._matched: dict[fx.Node, fx.Node | None] = {}
        for node in old.nodes:
            if node.op == "call_function":
                try:
                    self._index.setdefault(self._key(node, lambda n: n), node)
                except _NoMatch:
                    continue

    @staticmethod
    def of(old: fx.Graph, env: dict[fx.Node, fx.Node]) -> "_ReplacedBody | None":
        """The replaced body ``old``, if any of its ops has a source to lend."""
        if not any(n.meta.get(SOURCE) or IPU in n.meta for n in old.nodes):
            return None
        return _ReplacedBody(old, env)

    def placement_of(self, node: fx.Node) -> dict[str, Any]:
        """The IPU and pipeline stage of ``node``'s counterpart (empty when it has none)."""
        match = self._match(node)
        return {key: match.meta[key] for key in (IPU, PIPELINE_STAGE) if key in match.meta} if match is not None else {}

    def source_of(self, node: fx.Node) -> str | None:
        """The source of ``node``'s counterpart (``node``: a traced node, visited in order)."""
        match = self._match(node)
        return match.meta.get(SOURCE) if match is not None and match.op == "call_function" else None

    def _match(self, node: fx.Node) -> fx.Node | None:
        if node in self._matched:
            return self._matched[node]
        match = None
        if node.op == "placeholder":
            bound = self._env.get(node)
            match = self._placeholders.get(bound.name) if bound is not None else None
        elif node.op == "get_attr":
            match = self._attrs.get(node.target)
        elif node.op == "call_function":
            try:
                match = self._index.get(self._key(node, self._match))
            except _NoMatch:
                match = None
            if match is None and node.target in _SEE_THROUGH and node.args and isinstance(node.args[0], fx.Node):
                match = self._match(node.args[0])
        self._matched[node] = match
        return match

    @staticmethod
    def _key(node: fx.Node, counterpart: Any) -> tuple:
        target = node.target
        if is_call_graph_node(node):
            key, args = _call_graph_args(node)
            return ("call", call_entry(key).graph, _hashable(tuple(args), counterpart))
        if isinstance(target, CallTarget):
            return ("call", target.graph, _hashable(tuple(node.args), counterpart))
        return (target, _hashable(tuple(node.args), counterpart), _hashable(dict(node.kwargs), counterpart))


def _hashable(value: Any, counterpart: Any) -> Any:
    if isinstance(value, fx.Node):
        match = counterpart(value)
        if match is None:
            raise _NoMatch
        return match
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v, counterpart) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v, counterpart)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", value.start, value.stop, value.step)
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def returns_view(target: Any) -> bool:
    """True for aten ops whose result aliases their first input (view, t, expand...)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def to_meta(value: Any) -> Any:
    """Meta tensors of the shapes, dtypes and strides of a traced value (strides kept: code
    traced later on the value, a segment's or a callee's, must see the layout it runs on)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(to_meta(v) for v in value)
    return value
