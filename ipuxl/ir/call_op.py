"""``ipuxl::call_graph``: a call of a shared graph inside a make_fx trace.

make_fx records aten ops; a call of an outlined graph must survive tracing as one
node instead of being traced through (which would copy the callee's ops once per
call). This custom op is that node: ``call_graph(key, [tensors])`` stands for "call
the graph registered under ``key``". Its fake kernel returns empty tensors of the
callee's output specs, so a trace costs one node per call whatever the callee's
size. Two places make such traces:

* module capture (``capture.blocks``) calls a repeated block module's graph, traced
  once, from every place the block runs;
* autodiff (``passes.autodiff``) differentiates a called graph once and calls it
  through ``CallGraphFunction``, an ``autograd.Function`` whose backward calls the
  callee's grad graph, so the joint trace holds one call per forward and per
  backward call site.

Layouts: a callee's code is traced for the strides its inputs had when it was
traced (a ``view`` there assumes them), and its outputs have the strides its trace
gave them. A call keeps that contract: an argument in another layout (the gradient
of a ``permute`` reaching a block's backward, a channels-last image reaching a block
traced contiguous) is copied into the callee's layout first, as AOTAutograd makes
tangents contiguous, and the fake kernel gives each result the callee's strides, so
the caller's trace sees the layouts the program will have when it runs.

``copy_fx_body`` turns the nodes back into IR calls (``CallTarget``) when a traced
body is imported. Keys are process-wide; an entry lives as long as its owner
(a ``TracedModule`` or one autodiff) holds it.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Sequence

import torch

from ipuxl.errors import AutodiffError, PassError
from ipuxl.ir.tensor import TensorSpec

__all__ = ["CallEntry", "CallGraphFunction", "call_entry", "is_call_graph_node", "node_strides", "to_layout",
           "zeros_in_layout"]

_ENTRIES: "weakref.WeakValueDictionary[int, CallEntry]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()

# backward(saved inputs, saved outputs, output grads) -> one grad (or None) per input
BackwardRule = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]],
                        list[torch.Tensor | None]]
Strides = tuple[int, ...]


def node_strides(nodes: Sequence[Any]) -> list[Strides | None]:
    """The strides of each fx node's traced value (None where it has no tensor value)."""
    vals = [getattr(n, "meta", {}).get("val") for n in nodes]
    return [tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in vals]


def zeros_in_layout(node: Any) -> torch.Tensor:
    """Zeros of the shape, dtype and strides of an fx node's traced value: an example input
    for tracing code that will run on that value (a ``view`` traced on it stays valid)."""
    val = node.meta["val"]
    return torch.zeros_like(torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype))


def _graph_strides(graph: Any) -> tuple[list[Strides | None] | None, list[Strides | None] | None]:
    """Input and output strides of an IR graph's traced values (None when it has no fx graph)."""
    if graph is None or not hasattr(graph, "fx"):
        return None, None
    return node_strides([t.node for t in graph.inputs]), node_strides([t.node for t in graph.outputs])


def _same_layout(t: torch.Tensor, strides: Strides) -> bool:
    """``t`` has ``strides`` wherever they matter (a dimension of size 1 has any stride)."""
    return len(strides) == t.dim() and all(size == 1 or a == b for size, a, b in zip(t.shape, t.stride(), strides))


def to_layout(t: Any, strides: Strides | None) -> Any:
    """``t`` itself when it has the layout ``strides`` (or is not a tensor), else a copy in it."""
    if strides is None or not isinstance(t, torch.Tensor) or _same_layout(t, strides):
        return t
    if strides == torch.empty(t.shape, device="meta").stride():
        return t.contiguous()
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    return out.copy_(t)


class CallEntry:
    """What one key of ``ipuxl::call_graph`` calls.

    Attributes:
        name: the callee's name (messages, the IR graph's name).
        out_specs: shapes and dtypes of the callee's outputs (the fake kernel's results).
        graph: the IR graph the call becomes when the trace is imported (may be set later).
        backward: the gradient rule when the call is differentiable (``CallGraphFunction``).
        run: eager implementation, for running a traced function on real tensors.
        in_strides, out_strides: the layouts the callee was traced for (see the module
            docstring); read off ``graph``'s traced values when not given; None: any layout.
    """

    def __init__(self, name: str, out_specs: Sequence[TensorSpec], *, graph: Any = None,
                 backward: BackwardRule | None = None, run: Callable[..., Sequence[torch.Tensor]] | None = None,
                 in_strides: Sequence[Strides | None] | None = None,
                 out_strides: Sequence[Strides | None] | None = None):
        self.key = next(_KEYS)
        self.name = name
        self.out_specs = list(out_specs)
        self.graph = graph
        self.backward = backward
        self.run = run
        graph_in, graph_out = _graph_strides(graph)
        self.in_strides = list(in_strides) if in_strides is not None else graph_in
        self.out_strides = list(out_strides) if out_strides is not None else graph_out
        _ENTRIES[self.key] = self

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Record (or, on real tensors, run) one call; differentiable when ``backward`` is set.
        Arguments in another layout than the callee's are copied into it first."""
        if self.in_strides is not None and len(self.in_strides) == len(args):
            args = tuple(to_layout(a, s) for a, s in zip(args, self.in_strides))
        if self.backward is not None:
            return CallGraphFunction.apply(self.key, *args)
        return tuple(torch.ops.ipuxl.call_graph(self.key, list(args)))

    def __repr__(self) -> str:
        return f"CallEntry({self.key}, {self.name!r}, {len(self.out_specs)} outputs)"


def call_entry(key: int) -> CallEntry:
    entry = _ENTRIES.get(key)
    if entry is None:
        raise PassError(f"internal: no graph is registered under call key {key} (its owner was released)")
    return entry


def is_call_graph_node(node: Any) -> bool:
    return getattr(node, "op", None) == "call_function" and node.target is torch.ops.ipuxl.call_graph.default


@torch.library.custom_op("ipuxl::call_graph", mutates_args=())
def _call_graph(key: int, args: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = call_entry(key)
    if entry.run is None:
        raise PassError(f"internal: the call of graph '{entry.name}' has no eager implementation")
    # Results must not alias the arguments (custom op rule; PopXL call outputs are new tensors).
    ids = {a.untyped_storage().data_ptr() for a in args}
    return [t.clone() if t.untyped_storage().data_ptr() in ids else t for t in entry.run(*args)]


@_call_graph.register_fake
def _(key: int, args: list[torch.Tensor]) -> list[torch.Tensor]:
    device = args[0].device if args else torch.device("cpu")
    entry = call_entry(key)
    strides = entry.out_strides if entry.out_strides is not None else [None] * len(entry.out_specs)
    return [torch.empty(spec.shape, dtype=spec.dtype, device=device) if s is None or len(s) != len(spec.shape)
            else torch.empty_strided(spec.shape, s, dtype=spec.dtype, device=device)
            for spec, s in zip(entry.out_specs, strides)]


class CallGraphFunction(torch.autograd.Function):
    """A differentiable ``call_graph``: the backward calls the entry's gradient rule.

    ``setup_context`` makes it work under ``torch.func`` transforms (autodiff traces
    ``torch.func.vjp`` with make_fx).
    """

    @staticmethod
    def forward(key: int, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.ops.ipuxl.call_graph(key, list(args)))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        key, *args = inputs
        ctx.key, ctx.n_args = key, len(args)
        ctx.save_for_backward(*args, *output)
        ctx.set_materialize_grads(False)  # no zeros traced for outputs nothing reads (saved activations)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        entry = call_entry(ctx.key)
        if entry.backward is None:  # pragma: no cover - __call__ only applies this with a rule
            raise AutodiffError(f"the call of graph '{entry.name}' has no gradient rule")
        saved = ctx.saved_tensors
        return (None, *entry.backward(saved[:ctx.n_args], saved[ctx.n_args:], grads))
