"""Where in the user's code something happened: the innermost frame outside ipuxl.

Errors say where (``where=``) with the user's source line. This module sits below every
other ipuxl module (it imports none), so the bottom layer (``dtypes``) and the IR alike
can name the line; ``ipuxl.ir.context.user_source_line`` is its public name.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import types

import torch

__all__ = ["SKIP_PREFIXES", "STDLIB_DIR", "user_source_line", "is_user_file"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames in these files are ipuxl internals or context-manager plumbing, not user code.
# torch frames appear when ipuxl calls back through torch utilities (pytree maps).
SKIP_PREFIXES = (_PACKAGE_DIR + os.sep, os.path.abspath(contextlib.__file__),
                 os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_THIRD_PARTY = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


@functools.lru_cache(maxsize=None)
def is_user_file(filename: str) -> bool:
    """A file of the user's code: not ipuxl's, torch's or the standard library's (installed
    third-party packages count as the user's)."""
    path = os.path.abspath(filename)
    if path.startswith(SKIP_PREFIXES):
        return False
    return not path.startswith(STDLIB_DIR) or any(d in path for d in _THIRD_PARTY)


def user_source_line() -> str | None:
    """``file:line in function`` of the innermost frame outside ipuxl, if any."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(SKIP_PREFIXES):
            return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None
