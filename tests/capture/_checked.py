"""The model of ``test_runtime_checks``, in a module of its own: pytest rewrites the ``assert``
statements of test files into ``if not ...: raise``, and these must stay Python's own."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

LIMIT = 50.0


def library_check(cond) -> None:
    """A library's check helper (as transformers' ``torch_compilable_check`` while compiling)."""
    torch._check(cond)


class Checked(nn.Module):
    """A classifier whose forward states a fact about its input in one of several ways."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)
        self.how = how

    def forward(self, x, y):
        how = self.how
        if how == "check":
            torch._check(x.abs().max().item() < LIMIT)
        elif how == "helper":
            library_check(x.abs().max().item() < LIMIT)
        elif how == "check_int":
            torch._check((x.abs() >= LIMIT).sum().item() * 2 + 1 <= 1)
        elif how == "check_tensor_all":
            torch._check_tensor_all(x.abs() < LIMIT)
        elif how == "assert_async":
            torch._assert_async((x.abs() < LIMIT).all(), "input out of range")
        elif how == "assert_item":
            assert x.abs().max().item() < LIMIT, "input out of range"
        elif how == "assert_tensor":
            assert (x.abs() < LIMIT).all()
        elif how == "assert_and":
            assert (x < LIMIT).all() and (x > -LIMIT).all(), "input out of range"
        elif how == "assert_not":
            assert not (x.abs() >= LIMIT).any(), "input out of range"
        elif how == "if":
            if x.abs().max().item() < LIMIT:
                x = x * 2
        elif how == "sqrt":
            torch._check(x.abs().max().item() ** 0.5 < LIMIT)
        out = self.head(self.lin(x).relu())
        return out, F.cross_entropy(out, y)
