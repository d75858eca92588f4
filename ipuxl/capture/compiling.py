"""Library code sees a capture as torch.export sees itself: ``is_compiling()`` is True.

Libraries written for ``torch.compile`` / ``torch.export`` keep eager-only work behind
``torch.compiler.is_compiling()`` (Hugging Face's ``is_torchdynamo_compiling()`` asks the
same): checks that read tensor values to warn (``warn_if_padding_and_no_attention_mask``)
or to take a shortcut (skipping an all-ones attention mask). A capture runs on fake
tensors, where such a read has no value, so it must take the traceable path too.
torch.export's non-strict mode, which traces with make_fx as a capture does, sets
torch's two flags for the length of its trace (``torch._export.utils._compiling_state_context``);
``compiling_state`` sets the same two, and restores them after.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.compiler

__all__ = ["compiling_state"]


@contextlib.contextmanager
def compiling_state() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` and ``is_exporting()`` answer True inside."""
    old = torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag
    torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = old
