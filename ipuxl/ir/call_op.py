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

__all__ = ["CallEntry", "CallGraphFunction", "call_entry", "is_call_graph_node"]

_ENTRIES: "weakref.WeakValueDictionary[int, CallEntry]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()

# backward(saved inputs, saved outputs, output grads) -> one grad (or None) per input
BackwardRule = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]],
                        list[torch.Tensor | None]]


class CallEntry:
    """What one key of ``ipuxl::call_graph`` calls.

    Attributes:
        name: the callee's name (messages, the IR graph's name).
        out_specs: shapes and dtypes of the callee's outputs (the fake kernel's results).
        graph: the IR graph the call becomes when the trace is imported (may be set later).
        backward: the gradient rule when the call is differentiable (``CallGraphFunction``).
        run: eager implementation, for running a traced function on real tensors.
    """

    def __init__(self, name: str, out_specs: Sequence[TensorSpec], *, graph: Any = None,
                 backward: BackwardRule | None = None, run: Callable[..., Sequence[torch.Tensor]] | None = None):
        self.key = next(_KEYS)
        self.name = name
        self.out_specs = list(out_specs)
        self.graph = graph
        self.backward = backward
        self.run = run
        _ENTRIES[self.key] = self

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Record (or, on real tensors, run) one call; differentiable when ``backward`` is set."""
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
    return [torch.empty(spec.shape, dtype=spec.dtype, device=device) for spec in call_entry(key).out_specs]


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
