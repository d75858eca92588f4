"""Where a variable's elements lie in the device's memory: padded rows for matmul weights.

A float matrix whose rows are a multiple of 256 bytes apart (a 784x512 or 512x512
float32 weight: 2 KiB) makes a small-batch GEMM slow on x86: the rows of a
block map to the same few cache sets (4K aliasing) and BLAS keeps evicting what
it just loaded. Rows 64 bytes further apart remove that. Measured on this
project's 2-core machine (one thread, batch 8, ``W`` as ``x @ W``'s right operand):
the forward ``x @ W``, the input gradient ``dy @ W.T`` and the fused update
``W.addmm_(x.T, dy)`` take 16% less time together for 784x512 and 512x512 weights.

So the session keeps such a variable in a buffer with ``cols + pad`` elements per
row and gives the program the ``(rows, cols)`` slice of it: the variable's values,
shape and dtype are the same, only its row stride differs. PopXL leaves the layout
of a variable's tiles to Poplar; this is the simulated device's choice of layout, on
CPU devices only (a GPU's caches are another matter, not measured).

A strided variable is only safe where every reader and writer of it accepts any
strides and nothing takes a view that would silently become a copy (``reshape``
of a padded matrix copies, and an in-place update of that copy would be lost). So
a variable is padded only when every use of it in the compiled program, through
the calls of compiled subgraphs, is on the short list below (matmuls, transposes,
their in-place updates); any other use keeps it contiguous.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

__all__ = ["PAD_BYTES", "needs_padding", "padded_like", "paddable_attrs"]

PAD_BYTES = 64
"""How much further apart (in bytes) a padded variable's rows are."""

_ALIASED_STRIDE = 256  # rows this many bytes apart (or a multiple) alias in the cache
_MIN_ELEMENTS = 1 << 14  # smaller matrices sit in the cache anyway

_aten = torch.ops.aten
_READS = {_aten.mm.default, torch.mm, torch.matmul, _aten.matmul.default}
"""Ops that only read the variable, any strides: an argument of a matmul."""
_ADDMM = {_aten.addmm.default, torch.addmm}
"""``addmm(c, a, b)``: reads ``a``/``b`` with any strides (``c`` is also fine: read only)."""
_VIEWS = {_aten.t.default, torch.t, torch.Tensor.t, _aten.transpose.int, torch.transpose, torch.Tensor.transpose}
"""Transposes: the result is a view with the same padded rows (now columns); its uses are checked too."""
_UPDATES = {torch.Tensor.addmm_, _aten.addmm_.default, torch.Tensor.add_, _aten.add_.Tensor, torch.Tensor.sub_,
            _aten.sub_.Tensor, torch.Tensor.mul_, _aten.mul_.Tensor, torch.Tensor.copy_, _aten.copy_.default}
"""In-place updates of their first argument, any strides (a matmul update, a scaled add, a copy)."""


def needs_padding(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a contiguous matrix) has rows a multiple of 256 bytes apart
    and is large enough for that to matter."""
    return (tensor.dim() == 2 and tensor.is_floating_point() and tensor.is_contiguous()
            and tensor.numel() >= _MIN_ELEMENTS and tensor.shape[0] > 1
            and (tensor.shape[1] * tensor.element_size()) % _ALIASED_STRIDE == 0)


def padded_like(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the matrix ``tensor`` whose rows are ``PAD_BYTES`` further apart."""
    rows, cols = tensor.shape
    pad = PAD_BYTES // tensor.element_size()
    buffer = torch.zeros((rows, cols + pad), dtype=tensor.dtype, device=tensor.device)
    matrix = buffer[:, :cols]
    matrix.copy_(tensor)
    return matrix


Callee = Callable[[Any], "tuple[fx.GraphModule, int] | None"]
"""For the function a call node calls: the compiled module it runs and how many of
its first arguments are loop-carried (their values change between iterations), or
None when it is not a compiled graph's call."""


def paddable_attrs(module: fx.GraphModule, candidates: set[str], callee: Callee) -> set[str]:
    """The attributes among ``candidates`` whose every use in ``module`` (and the
    compiled graphs it calls) accepts a padded matrix."""
    uses: dict[str, list[fx.Node]] = {}
    for node in module.graph.nodes:
        if node.op == "get_attr" and node.target in candidates:
            uses.setdefault(str(node.target), []).append(node)
    checker = _Checker(callee)
    return {attr for attr, nodes in uses.items() if all(checker.safe(n) for n in nodes)}


class _Checker:
    def __init__(self, callee: Callee):
        self.callee = callee
        self.checked: dict[tuple[int, int], bool] = {}  # (module id, placeholder index) -> safe

    def safe(self, value: fx.Node) -> bool:
        """Every use of ``value`` (a padded matrix, or a transposed view of one) is on the list."""
        return all(self._use_is_safe(value, user) for user in value.users)

    def _use_is_safe(self, value: fx.Node, user: fx.Node) -> bool:
        if user.op != "call_function" or value in user.kwargs.values():
            return False
        positions = [i for i, a in enumerate(user.args) if a is value]
        target = user.target
        if target in _READS:
            return True
        if target in _ADDMM:
            return True
        if target in _VIEWS:
            return self.safe(user)
        if target in _UPDATES:
            return positions == [0] and self.safe(user)  # the result is the variable itself
        found = self.callee(target)
        if found is None:
            return False
        module, carried = found
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(user.args) or any(i < carried for i in positions):
            return False  # a loop-carried input is replaced by the body's result: not followed
        return all(self._placeholder_is_safe(module, placeholders, i) for i in positions)

    def _placeholder_is_safe(self, module: fx.GraphModule, placeholders: list[fx.Node], i: int) -> bool:
        key = (id(module), i)
        if key not in self.checked:
            self.checked[key] = False  # a recursive call of the same graph is not followed
            self.checked[key] = self.safe(placeholders[i])
        return self.checked[key]
