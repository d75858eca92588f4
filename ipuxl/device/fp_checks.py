"""Floating-point exception checks in a compiled graph (``kernels.fp_exceptions``), and the
float8 scale range check (``strict_float8_scales``).

When a program asks for the IPU's floating-point exceptions (PopART's
``enableFloatingPointChecks``: PopTorch's ``Options.Precision.enableFloatingPointExceptions(True)``,
PopXL's ``ir._pb_ir.getSessionOptions().enableFloatingPointChecks = True``, or the Poplar
engine option ``debug.floatPointOpException``), ``insert_checks`` puts a check before and
after every arithmetic op of a graph's generated code, after the device's rewrites (the ops
checked are those that run). The checks carry their op's name and source line, so a step
that raises is reported at that op (``device.failures``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.fx as fx

from ipuxl.ir.meta import MODIFIES, OP, SOURCE, WRITES
from ipuxl.kernels import float8, fp_exceptions

if TYPE_CHECKING:
    from ipuxl.ir.ir import Ir

__all__ = ["checks_enabled", "insert_checks", "strict_float8_scales"]

# Ops that move, select or make values without arithmetic: NaN and infinity pass through
# them on an IPU without raising (and the classifications read NaN by design).
_MOVES = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "reshape", "view_as", "permute", "transpose", "t", "expand",
    "expand_as", "slice", "slice_scatter", "select", "select_scatter", "diagonal", "diagonal_scatter",
    "as_strided", "as_strided_scatter", "unsqueeze", "squeeze", "flatten", "unflatten", "movedim", "unfold",
    "cat", "concat", "stack", "split", "split_with_sizes", "chunk", "unbind", "narrow", "clone", "copy", "copy_",
    "detach", "detach_", "alias", "lift_fresh_copy", "contiguous", "index_select", "gather", "index", "_unsafe_index",
    "embedding", "take", "where", "masked_fill", "masked_fill_", "masked_scatter", "index_put", "index_put_",
    "_index_put_impl_", "scatter", "scatter_", "roll", "flip", "repeat", "tile", "constant_pad_nd", "zeros_like",
    "empty_like", "full_like", "ones_like", "new_zeros", "new_ones", "new_empty", "new_full", "full", "zeros",
    "ones", "empty", "empty_strided", "arange", "scalar_tensor", "fill", "fill_", "zero_", "resize_",
    "isnan", "isinf", "isfinite", "isposinf", "isneginf", "nan_to_num", "nan_to_num_", "getitem", "next",
    "_local_scalar_dense", "item",
})
# Kernel modules that move data between the host, remote buffers and the device.
_MOVING_MODULES = frozenset({"ipuxl.kernels.host_io", "ipuxl.kernels.remote", "ipuxl.kernels.fp_exceptions"})


def checks_enabled(ir: "Ir") -> bool:
    """Whether ``ir``'s PopART options ask for floating-point exceptions."""
    options = ir.session_options
    engine = str(options.engineOptions.get("debug.floatPointOpException", "false")).lower()
    return bool(options.enableFloatingPointChecks) or engine == "true"


def insert_checks(code: fx.Graph) -> int:
    """Check every arithmetic op of ``code`` (see the module docstring); the number checked."""
    checked = 0
    for node in list(code.nodes):
        name = _arithmetic(node)
        if name is None:
            continue
        label = f"op '{name}'"  # the session's error adds the user's line (device.failures)
        meta = {OP: node.meta.get(OP) or name, SOURCE: node.meta.get(SOURCE)}
        inputs = node.all_input_nodes
        with code.inserting_before(node):
            before = code.call_function(fp_exceptions.operands, (label, *inputs))
        written = inputs if _writes(node, name) else []
        with code.inserting_after(node):
            after = code.call_function(fp_exceptions.results, (label, before, node, *written))
        for check in (before, after):
            check.meta.update(meta)
        checked += 1
    return checked


def _arithmetic(node: fx.Node) -> str | None:
    """The name of the op ``node`` runs if it computes on floating-point values, else None."""
    if node.op != "call_function":
        return None
    target: Any = node.target
    packet = getattr(target, "_overloadpacket", None)
    name = str(getattr(packet, "__name__", None) or getattr(target, "__name__", ""))
    module = getattr(target, "__module__", None) or ""
    if not name or name in _MOVES or module in _MOVING_MODULES or module == "ipuxl.compiled":
        return None  # a called graph's code is checked inside it
    return name


def _writes(node: fx.Node, name: str) -> bool:
    """Whether ``node`` may write its inputs in place: an op recorded as writing, a mutable
    aten op, a Tensor method named as in-place (``addmm_``), or a kernel of ipuxl's."""
    schema = getattr(node.target, "_schema", None)
    module = getattr(node.target, "__module__", None) or ""
    return bool(node.meta.get(WRITES) or node.meta.get(MODIFIES) or (schema is not None and schema.is_mutable)
                or name.endswith("_") or (schema is None and module.startswith("ipuxl.kernels")))


_SCALED = (float8.pow2scale_then_cast, float8.cast_then_pow2scale)


def strict_float8_scales(code: fx.Graph, strict: bool) -> None:
    """Have ``code``'s float8 scalings raise on a scale out of the device's range (``strict``:
    PopART's ``throwIfLog2ScaleTensorNotInRange``, on by default) or clip it."""
    for node in code.nodes:
        if node.op == "call_function" and node.target in _SCALED:
            node.kwargs = {**node.kwargs, "strict": strict}
