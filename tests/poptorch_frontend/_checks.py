"""Shared checks for the PopTorch-layer tests."""
from __future__ import annotations

import contextlib
import os
from typing import Callable, ContextManager, Iterator

import pytest

from ipuxl.errors import IpuxlError


def raises_in(test_file: str) -> Callable[..., ContextManager[pytest.ExceptionInfo]]:
    """``raises(error, *fragments)``: ``pytest.raises`` that also checks message fragments,
    that ``where`` names ``test_file`` (the user's line) and that a fix is given."""
    name = os.path.basename(test_file)

    @contextlib.contextmanager
    def raises(error: type[IpuxlError], *fragments: str) -> Iterator[pytest.ExceptionInfo]:
        with pytest.raises(error) as info:
            yield info
        message = str(info.value)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in:\n{message}"
        assert info.value.where and name in info.value.where
        assert info.value.fix

    return raises


def as_poptorch(expected):
    """An eager result as PopTorch returns it from the device: int64 comes back int32
    (the IPU has no 64-bit integers; upstream's own tests check this)."""
    import torch

    return expected.to(torch.int32) if expected.dtype == torch.int64 else expected
