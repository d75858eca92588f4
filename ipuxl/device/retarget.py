"""Programs traced on the host, compiled for another device.

Capture traces models and builds graphs on the CPU (fake tensors of the host's weights),
so a lowered graph can name the CPU where the program means "the device": factory ops
(``arange``, ``zeros``, ``scalar_tensor``, ``_to_copy``...) made with ``device=cpu`` (a
model's ``torch.arange(n, device=ids.device)``), and kernels that exist only for CPU
tensors (``scaled_dot_product_attention`` traced as the CPU's fused attention). On a
session whose device is not the CPU, ``for_device`` rewrites those before the device's
rewrites run:

* every ``device=cpu`` keyword argument names the session's device instead (nothing in a
  device program lives on the host: host data arrives through streams);
* the CPU's fused attention and its backward become ``kernels.attention``'s
  ``attention_forward`` / ``attention_backward`` (the same results from matrix products,
  with the traced outputs' layouts).

On the CPU the graph is left as it is.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ipuxl.kernels.attention import attention_backward, attention_forward
from ipuxl.passes.result import PassResult

__all__ = ["for_device", "device_arguments", "portable_attention"]

_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: (attention_forward, 2),
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (attention_backward, 3)}
"""The CPU-only kernels and their replacements, with their number of outputs."""


def _is_cpu(value: Any) -> bool:
    return (isinstance(value, torch.device) and value.type == "cpu") or value == "cpu"


def _layouts(node: fx.Node, outputs: int) -> tuple:
    """The traced (shape, stride) of each of a multi-output node's outputs (None where unknown)."""
    val = node.meta.get("val")
    if not isinstance(val, (tuple, list)) or len(val) != outputs:
        return (None,) * outputs
    return tuple((tuple(v.shape), tuple(v.stride())) if isinstance(v, torch.Tensor) else None for v in val)


def for_device(graph: fx.Graph, device: torch.device) -> PassResult:
    """Rewrite a lowered graph traced on the CPU to run on ``device`` (module docstring)."""
    if device.type == "cpu":
        return PassResult(graph, False)
    moved = device_arguments(graph, device).modified
    return PassResult(graph, portable_attention(graph).modified or moved)


def device_arguments(graph: fx.Graph, device: torch.device) -> PassResult:
    """Every ``device=cpu`` keyword argument names ``device`` instead."""
    modified = False
    for node in graph.nodes:
        if node.op == "call_function" and _is_cpu(node.kwargs.get("device")):
            node.kwargs = {**node.kwargs, "device": device}
            modified = True
    return PassResult(graph, modified)


def portable_attention(graph: fx.Graph) -> PassResult:
    """The CPU's fused attention and its backward become ``kernels.attention``'s functions."""
    modified = False
    for node in graph.nodes:
        replacement = _ATTENTION.get(node.target) if node.op == "call_function" else None
        if replacement is None:
            continue
        kernel, outputs = replacement
        names = [a.name for a in node.target._schema.arguments]
        bound = dict(zip(names, node.args), **node.kwargs)
        bound["layouts"] = _layouts(node, outputs)
        node.target, node.args, node.kwargs = kernel, (), bound
        modified = True
    return PassResult(graph, modified)
