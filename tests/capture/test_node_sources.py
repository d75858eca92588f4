"""Each traced node's user line (``capture.node_sources``): the innermost ``forward`` frame in
the user's files when the node was made, as make_fx's ``record_stack_traces`` chose it."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ipuxl.capture.failures import user_line
from ipuxl.capture.trace import trace_module
from ipuxl.errors import TraceError


def _scale(x: torch.Tensor) -> torch.Tensor:  # a helper of the user's: its caller's forward line is quoted
    return x * 3.0


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))  # line INNER


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = _scale(self.inner(x))  # line OUTER
        return F.mse_loss(h, y)  # line LOSS


def _line(cls: type, marker: str) -> int:
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def _sources(traced) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for node in traced.gm.graph.nodes:
        if node.op == "call_function":
            found.setdefault(str(node.target), set()).add(user_line(node.meta.get("stack_trace")))
    return found


def test_each_node_records_the_innermost_user_forward_line():
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    traced = trace_module(Outer(), (x, y), training=True, need_loss=True)
    sources = _sources(traced)
    here = __file__
    inner = f"{here}:{_line(Inner, 'line INNER')} in forward"
    outer = f"{here}:{_line(Outer, 'line OUTER')} in forward"
    loss = f"{here}:{_line(Outer, 'line LOSS')} in forward"
    assert sources["aten.addmm.default"] == {inner}  # inside nn.Linear's forward: torch's, not the user's
    assert sources["aten.tanh.default"] == {inner}
    assert sources["aten.mul.Tensor"] == {outer}  # made in _scale, a helper called from Outer.forward
    assert loss in sources["aten.mse_loss.default"]
    # placeholders and the output are made outside any forward
    assert all("stack_trace" not in n.meta for n in traced.gm.graph.nodes if n.op in ("placeholder", "output"))


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0].sum()  # line MASK


def test_a_refused_op_quotes_its_forward_line():
    with pytest.raises(TraceError) as info:
        trace_module(DataDependent(), (torch.randn(5),), training=False, need_loss=False)
    assert f"{__file__}:{_line(DataDependent, 'line MASK')} in forward" in str(info.value)
