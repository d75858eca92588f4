"""PopTorch's checks of ``set_overlap_for_input`` / ``set_overlap_for_output`` in a captured model.

While a model is captured, each mark is an ``aten.clone`` node carrying ``ops.hints.OVERLAP``
(``("input" | "output", OverlapMode)``). :func:`check_overlap` reads them in the capture's
graph and raises upstream's errors (a ``poptorch.Error``), in upstream's order:

1. an input mark must be applied to a model input, and be that input's only use;
2. an output mark must be returned by the model, and the marked tensor returned only
   through it, once;
3. overlapping (any mode but ``NoOverlap``) needs a strategy other than
   ``PipelinedExecution`` (``ShardedExecution`` on one IPU) ...
4. ... and IO tiles (``Options.TensorLocations.numIOTiles``).

The marks change nothing else on a simulated device: it has no IO tiles, so transfers
and compute do not overlap.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from ipuxl.capture.trace import TracedModule
from ipuxl.errors import TraceError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.blocks import PipelinedExecution, ShardedExecution
from ipuxl.poptorch_compat.enums import OverlapMode
from ipuxl.poptorch_compat.ops.hints import OVERLAP

__all__ = ["check_overlap"]


def check_overlap(traced: TracedModule, options: Any) -> None:
    """Raise upstream's error for a misused overlap mark in ``traced`` (see the module docstring).

    Raises:
        TraceError: (a ``poptorch.Error``) a mark is misplaced, or the options cannot overlap IO.
    """
    graph = traced.gm.graph
    marks = [node for node in graph.nodes if OVERLAP in node.meta]
    if not marks:
        return
    inputs = [node for node in graph.nodes if node.op == "placeholder"][:len(traced.input_names)]
    names = dict(zip(inputs, traced.input_names))
    outputs = _output_nodes(graph)
    for node in marks:
        side, _ = node.meta[OVERLAP]
        source = node.args[0]
        if side == "input":
            _check_input(source, names)
        else:
            _check_output(node, source, outputs)
    if all(node.meta[OVERLAP][1] is OverlapMode.NoOverlap for node in marks):
        return
    strategy = getattr(options, "execution_strategy", None)
    if isinstance(strategy, PipelinedExecution) and not isinstance(strategy, ShardedExecution):
        raise _error("Overlapped IO is not supported with poptorch.PipelinedExecution. If you are using only one IPU, "
                     "please switch to poptorch.ShardedExecution.",
                     "call opts.setExecutionStrategy(poptorch.ShardedExecution())")
    if not options.TensorLocations.toDict().get("numIOTiles", 0):
        raise _error("No IO tiles allocated. You must allocate at least 32 IO tiles using "
                     "poptorch.Options().TensorLocations.numIOTiles.",
                     "call opts.TensorLocations.numIOTiles(32)")


def _check_input(source: Any, names: dict[fx.Node, str]) -> None:
    if source not in names:
        raise _error("poptorch.set_overlap_for_input applied on a node which is not a tensor input to the model.",
                     "apply poptorch.set_overlap_for_input to an input of forward, before any other op")
    if len(source.users) > 1:
        raise _error(f"poptorch.set_overlap_for_input must be the only op applied to an input. This is not the case "
                     f"for input {names[source]} to the model.",
                     f"use only the result of poptorch.set_overlap_for_input({names[source]}, ...) in forward")


def _check_output(node: fx.Node, source: Any, outputs: list[Any]) -> None:
    if node not in outputs:
        raise _error("poptorch.set_overlap_for_output applied on a node which is not a tensor output to the model.",
                     "apply poptorch.set_overlap_for_output to a tensor forward returns, and return its result")
    if outputs.count(node) > 1 or source in outputs:
        raise _error("poptorch.set_overlap_for_output cannot be used with a tensor that is returned twice. Please "
                     "check all returned tensors including those nested in tuples/lists.",
                     "return the tensor once, through poptorch.set_overlap_for_output")


def _output_nodes(graph: fx.Graph) -> list[Any]:
    output = next(node for node in reversed(graph.nodes) if node.op == "output")
    values = output.args[0]
    return list(values) if isinstance(values, (list, tuple)) else [values]


def _error(what: str, fix: str) -> TraceError:
    return TraceError(what, where=user_source_line(), fix=fix)
