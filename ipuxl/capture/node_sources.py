"""Where in the user's ``forward`` each traced node was made: its ``meta["stack_trace"]``.

Errors and the IR quote the user's line of an op (``capture.failures.user_line``,
``ir.fx_import``): the innermost frame of a ``forward`` (or of a function torch marks as
a stack-trace anchor) in the user's files (``source.is_user_file``). make_fx's own
``record_stack_traces`` captures and formats the whole Python stack for every node,
which cost ResNet-50's first call a tenth of its capture; ``recording_sources`` records
that one frame instead, found by walking the stack when the tracer makes the node. The
record keeps the traceback format (``File "...", line N, in forward``) the readers parse.
"""
from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Iterator

import torch.fx.proxy
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ipuxl.source import is_user_file

__all__ = ["recording_sources", "forward_frame_line"]

_FORWARD_NAMES = frozenset({"forward"})
# (file, function) pairs torch marks as stack-trace anchors (torch >= 2.12; none before)
_STACK_TRACE_ANCHORS: Any = getattr(torch.fx.proxy, "_STACK_TRACE_ANCHORS", frozenset())
_marks: dict[types.CodeType, bool] = {}  # code object -> whether its frames are user forward frames


def _is_mark(code: types.CodeType) -> bool:
    known = _marks.get(code)
    if known is None:
        named = code.co_name in _FORWARD_NAMES or (code.co_filename, code.co_name) in _STACK_TRACE_ANCHORS
        known = _marks[code] = named and is_user_file(code.co_filename)
    return known


def forward_frame_line(frame: types.FrameType | None) -> str | None:
    """``File "...", line N, in name`` of the innermost user ``forward`` frame at or above ``frame``."""
    while frame is not None:
        code = frame.f_code
        if _is_mark(code):
            return f'File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}'
        frame = frame.f_back
    return None


@contextlib.contextmanager
def recording_sources() -> Iterator[None]:
    """Inside a make_fx trace: each node the tracer makes from now on gets the user's
    ``forward`` line as its ``meta["stack_trace"]`` (unless it has one). Restored on exit."""
    mode = get_proxy_mode()
    if mode is None:  # not under make_fx
        yield
        return
    tracer: Any = mode.tracer
    previous = vars(tracer).get("create_node")  # an outer recording's
    make_node = tracer.create_node

    def create_node(*args: Any, **kwargs: Any) -> Any:
        node = make_node(*args, **kwargs)
        if not node.meta.get("stack_trace"):
            line = forward_frame_line(sys._getframe(1))
            if line is not None:
                node.meta["stack_trace"] = line
        return node

    tracer.create_node = create_node
    try:
        yield
    finally:
        if previous is None:
            del tracer.create_node
        else:
            tracer.create_node = previous
