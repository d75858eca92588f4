"""Lower an IR graph to executable PyTorch code (an fx ``GraphModule``).

Used by the device to compile each graph once and by passes that trace a graph
(autodiff). Steps:

1. copy the graph's nodes in program order (in-place ops keep their position),
   copying a view (reshape, slice...) that an in-place op writes through or whose
   source is written while the view is still to be read, because PopXL's
   view-like ops return new tensors;
2. replace each subgraph call by a direct call of the callee's compiled code
   (``callee_fn(graph)``, so a graph called from many sites exists once), cloning
   inputs that the callee modifies unless they are passed by reference; a graph
   the caller asks to ``inline`` (the device: graphs with one call site) is copied
   in place of its call instead, with the same input and output copying rules;
3. make every ``get_attr`` (variables, constants) an attribute of the module;
4. add the output node returning the graph's outputs as a tuple, copying outputs
   that share storage with an input, a constant or another output (PopXL call outputs
   are new tensors), except where no caller could tell (``ir.output_sharing``: nothing
   writes that storage while the output is read; the device decides over all call sites).

Host transfers (when the device gives ``io_index``, stream -> cursor position): a
graph that loads or stores a stream, itself or through a callee, takes the run's
cursors as its first argument (``ipuxl_host_io``) and passes them on to such
callees, so compiled callees stay the same for every replica. A load becomes
``next(ipuxl_host_io[k])``; a store's slot becomes the same, right before the copy.
A branch call of a conditional (``IO_GATE``) passes its callee the cursors through
``kernels.host_io.gate_cursors``: blank ones unless the branch is taken.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, cast

import torch
import torch.fx as fx

from ipuxl.ir.aliases import written_nodes
from ipuxl.ir.calls import (
    RepeatTarget, callee_of, does_host_io, is_call, is_host_transfer, is_repeat, repeat_count, run_repeat,
)
from ipuxl.ir.graph import identifier
from ipuxl.ir.meta import BY_REF_ARGS, IO_GATE, STREAM
from ipuxl.ir.output_sharing import OutputSharing, views_to_copy
from ipuxl.kernels.host_io import gate_cursors

if TYPE_CHECKING:
    from ipuxl.ir.graph import Graph
    from ipuxl.ir.streams import Stream

__all__ = ["lower_graph", "lower_to_fx", "graph_callable", "compiled_callee", "HOST_IO"]

CalleeFn = Callable[["Graph"], Callable[..., Any]]

#: The name of the cursors argument of a lowered graph that does host IO.
HOST_IO = "ipuxl_host_io"


@dataclass
class _HostIO:
    """Host-transfer lowering of one graph: where each stream's cursor is, the cursors
    argument (None when the graph does no host IO) and which graphs do host IO."""

    index: Mapping["Stream", int]
    arg: fx.Node | None = None
    uses_io: dict["Graph", bool] = field(default_factory=dict)

    def does_io(self, graph: "Graph") -> bool:
        if graph not in self.uses_io:
            self.uses_io[graph] = does_host_io(graph)
        return self.uses_io[graph]

    def next_slice(self, new: fx.Graph, node: fx.Node) -> fx.Node:
        """``next(cursors[k])`` for the stream of load or store slot ``node``."""
        assert self.arg is not None, "a graph with host transfers takes the cursors"
        cursor = new.call_function(operator.getitem, (self.arg, self.index[node.meta[STREAM]]))
        value = new.call_function(next, (cursor,))
        value.meta.update(node.meta)
        return value


def graph_callable(graph: "Graph") -> Callable[..., tuple]:
    """Lower ``graph`` and its callees (uncached): ``fn(*inputs) -> tuple(outputs)``."""
    cache: dict[Any, Callable[..., tuple]] = {}

    def callee_fn(g: "Graph") -> Callable[..., tuple]:
        if g not in cache:
            cache[g] = compiled_callee(g, lower_graph(g, callee_fn).forward)
        return cache[g]

    return callee_fn(graph)


def lower_graph(graph: "Graph", callee_fn: CalleeFn, attrs: dict[str, torch.Tensor] | None = None,
                *, inline: Callable[["Graph"], bool] | None = None,
                io_index: Mapping["Stream", int] | None = None) -> fx.GraphModule:
    """Build a GraphModule for ``graph`` (see the module docstring for the steps).

    Args:
        graph: the graph to lower.
        callee_fn: compiled code of a called graph (shared by all its call sites).
        attrs: tensors for ``get_attr`` nodes beyond the graph's constants (variables).
        inline: graphs for which this returns True are copied into the caller instead
            of called (the device inlines graphs with a single call site).
        io_index: the position of each stream's cursor in the run's cursors (the
            device's); None leaves host loads as their IR op (outside a Session).
    """
    root, new = lower_to_fx(graph, callee_fn, attrs, inline=inline, io_index=io_index)
    return fx.GraphModule(root, new, class_name=identifier(f"ipuxl_{graph.name}"))


def lower_to_fx(graph: "Graph", callee_fn: CalleeFn, attrs: dict[str, torch.Tensor] | None = None,
                *, inline: Callable[["Graph"], bool] | None = None,
                io_index: Mapping["Stream", int] | None = None,
                sharing: OutputSharing | None = None) -> tuple[torch.nn.Module, fx.Graph]:
    """``lower_graph`` before code generation: the module holding the attributes and the
    fx graph, for passes that rewrite it before it becomes a GraphModule (code is then
    generated once). ``sharing``: which outputs stay aliases of inputs (the device's, over
    all call sites, returns a graph's outputs that share an input's storage as they are
    where every call site allows it); by default, decided from ``graph`` alone."""
    new = fx.Graph()
    root = torch.nn.Module()
    values = dict(graph.constant_data, **(attrs or {}))
    io = None
    if io_index is not None:
        io = _HostIO(io_index)
        if io.does_io(graph):
            io.arg = new.placeholder(HOST_IO)
    env = _arguments(new, graph, io)
    sharing = sharing if sharing is not None else OutputSharing()
    outputs = _copy_graph(new, root, graph, env, values, callee_fn, inline, sharing, prefix="",
                          shared_outputs=sharing.everywhere(graph), io=io)
    new.output(tuple(outputs))
    return root, new


def _arguments(new: fx.Graph, graph: "Graph", io: _HostIO | None) -> dict[fx.Node, fx.Node]:
    """The lowered function's arguments, one per placeholder of ``graph`` that stays one.

    fx writes a placeholder's ``target`` as the argument's name without checking it, so
    two equal targets, ``self``, or a name the code also uses (``torch``) give broken
    code. Each argument is named by its node's name instead: fx keeps node names unique
    and clear of keywords, builtins and the globals the code refers to.
    """
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.fx.nodes:
        if node.op != "placeholder" or (io is not None and is_host_transfer(node)):
            continue
        arg = new.placeholder("self_" if node.name == "self" else node.name)
        arg.target = arg.name
        arg.meta.update(node.meta)
        env[node] = arg
    return env


def _copy_graph(new: fx.Graph, root: torch.nn.Module, graph: "Graph", env: dict[fx.Node, fx.Node],
                values: dict[str, torch.Tensor], callee_fn: CalleeFn, inline: Callable[["Graph"], bool] | None,
                sharing: OutputSharing, prefix: str, shared_outputs: frozenset[int] = frozenset(),
                io: _HostIO | None = None) -> list[fx.Node]:
    """Copy ``graph``'s nodes into ``new`` (inputs already bound in ``env``); return its outputs.

    Outputs whose storage is an input's, a constant's or another output's are copied
    (PopXL returns new tensors), except those in ``shared_outputs``: ``sharing`` found, at the call site inlining this graph
    or at every call site of a graph compiled once, that no caller could tell them from
    copies (``ir.output_sharing``). With ``io``, host loads and store slots read the run's
    cursors (see the module docstring).
    """
    written_views = views_to_copy(graph)
    inlined: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.fx.nodes:
        if node in env:  # an input bound by the caller of an inlined graph
            continue
        if io is not None and is_host_transfer(node):
            if node.op != "placeholder":  # a load; a store's slot is taken right before the store
                env[node] = io.next_slice(new, node)
            continue
        if node.op == "get_attr":
            name = prefix + node.target
            if not hasattr(root, name):
                root.register_buffer(name, values[node.target], persistent=False)
            env[node] = new.get_attr(name)
            env[node].meta.update(node.meta)
        elif node.target is operator.getitem and node.args[0] in inlined:
            env[node] = inlined[node.args[0]][node.args[1]]
            continue
        elif _inlinable(node, inline):
            called = callee_of(node)
            bound = dict(zip((t.node for t in called.inputs), _call_args(new, node, env)))
            inlined[node] = _copy_graph(new, root, called, bound, dict(called.constant_data), callee_fn, inline,
                                        sharing, prefix=f"{prefix}{identifier(called.name)}__",
                                        shared_outputs=sharing.at_site(graph, node),
                                        io=_callee_io(new, graph, node, env, io))
            continue
        elif is_call(node):
            env[node] = _lower_call(new, node, env, callee_fn, _callee_io(new, graph, node, env, io))
        else:
            if io is not None:
                for arg in node.all_input_nodes:
                    if arg not in env and is_host_transfer(arg):
                        env[arg] = io.next_slice(new, arg)
            # A plain fx copy, deliberately not ir.copy.copy_node: the lowered graph is code,
            # not IR. Its alias records keep naming this IR graph's nodes; the device's
            # rewrites read them only as flags (``writes(node)``: does it write?), and a
            # rewrite may erase a node they would name in the code.
            env[node] = new.node_copy(node, lambda n: env[n])
        if node in written_views:
            env[node] = new.call_function(torch.clone, (env[node],))
    outputs = []
    copied_outputs = sharing.copy_candidates(graph) - shared_outputs
    for i, t in enumerate(graph.outputs):
        value = env[t.node]
        if i in copied_outputs:
            value = new.call_function(torch.clone, (value,))
        outputs.append(value)
    return outputs


def _callee_io(new: fx.Graph, graph: "Graph", node: fx.Node, env: dict, io: _HostIO | None) -> _HostIO | None:
    """The host IO of call ``node``'s callee: ``io``, or for a conditional's branch that
    transfers host data (``IO_GATE``) cursors gated by the condition (``gate_cursors``)."""
    gate = node.meta.get(IO_GATE)
    if io is None or io.arg is None or gate is None or not io.does_io(callee_of(node)):
        return io
    index, taken_when = gate
    slices: list[Any] = [None] * len(io.index)
    for stream, k in io.index.items():
        slices[k] = (tuple(stream.shape), stream.spec.dtype)
    gated = new.call_function(gate_cursors, (io.arg, env[graph.inputs[index].node], taken_when, tuple(slices)))
    return _HostIO(io.index, gated, io.uses_io)


def _inlinable(node: fx.Node, inline: Callable[["Graph"], bool] | None) -> bool:
    """True for a plain call (not a repeat) of a graph the caller asks to inline."""
    return inline is not None and is_call(node) and not is_repeat(node) and inline(callee_of(node))


def _call_args(new: fx.Graph, node: fx.Node, env: dict) -> list[fx.Node]:
    """A call's arguments, copying inputs the callee modifies unless passed by reference."""
    called = callee_of(node)
    args = [env[a] for a in node.args]
    by_ref = node.meta.get(BY_REF_ARGS, set())
    written = written_nodes(called)
    for i, placeholder in enumerate(called.inputs):
        if i not in by_ref and placeholder.node in written:
            args[i] = new.call_function(torch.clone, (args[i],))
    return args


def _lower_call(new: fx.Graph, node: fx.Node, env: dict, callee_fn: CalleeFn, io: _HostIO | None) -> fx.Node:
    """A direct call of the callee's code (a loop of it for a repeat); the cursors go
    first to a callee that does host IO."""
    called = callee_of(node)
    args = _call_args(new, node, env)
    fn = callee_fn(called)
    with_io = io is not None and io.does_io(called)
    if is_repeat(node):
        name = cast(RepeatTarget, node.target).__name__
        fn = _named(_repeat_fn(fn, repeat_count(node), len(called.outputs), with_io), name)
        fn.ipuxl_graph, fn.ipuxl_carried = called, len(called.outputs)  # type: ignore[attr-defined]
    if with_io:
        assert io is not None and io.arg is not None, "a caller of a graph with host IO takes the cursors"
        args = [io.arg, *args]
    lowered = new.call_function(fn, tuple(args))
    lowered.meta.update(node.meta)
    return lowered


def _repeat_fn(body: Callable[..., tuple], count: int, n_carried: int, with_io: bool) -> Callable[..., tuple]:
    body = getattr(body, "__wrapped__", body)  # the loop calls the callee's code itself: one frame less per iteration
    if with_io:
        def repeat_io(io: Any, *args: Any) -> tuple:
            return run_repeat(body, count, n_carried, args, io)

        return repeat_io

    def repeat(*args: Any) -> tuple:
        return run_repeat(body, count, n_carried, args)

    return repeat


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A plain function wrapper with a readable name, so fx codegen can refer to it."""
    def call(*args: Any) -> Any:
        return fn(*args)

    call.__name__ = call.__qualname__ = name
    call.__module__ = "ipuxl.compiled"
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def compiled_callee(graph: "Graph", forward: Callable[..., Any]) -> Callable[..., Any]:
    """The function call sites of ``graph`` refer to: one per graph, so generated code
    calls the same ``ipuxl_compiled_call_<graph>`` from every site. Its ``ipuxl_graph``
    is ``graph`` and ``ipuxl_carried`` 0 (a repeat's function: its loop-carried inputs)."""
    call = _named(forward, identifier(f"call_{graph.name}"))
    call.ipuxl_graph, call.ipuxl_carried = graph, 0  # type: ignore[attr-defined]
    return call
