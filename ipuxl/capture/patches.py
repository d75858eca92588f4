"""A patch of torch's globals that is in place while any capture runs, in any thread.

Some library code can only be captured if a torch global behaves otherwise while tracing
(flex attention's op, the guard that refuses an ``assert`` on data). ``CapturePatch``
applies such a patch when the first capture starts and undoes it when the last one ends (a
lock and a count), and tells the patched code whether *this* thread is capturing
(``active``): another thread calling the patched global meanwhile must get torch's own
behaviour, so the patched code checks ``active`` first.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

__all__ = ["CapturePatch"]


class CapturePatch:
    """``apply`` when the first capture in the process starts, ``restore`` when the last ends."""

    def __init__(self, apply: Callable[[], None], restore: Callable[[], None]):
        self._apply, self._restore = apply, restore
        self._lock = threading.Lock()
        self._count = 0  # captures in progress, in all threads
        self._thread = threading.local()  # .depth: those of this thread

    @classmethod
    def replacing(cls, owner: object, name: str, replacement: object) -> "CapturePatch":
        """The patch that sets ``owner.name`` to ``replacement`` while any capture runs, and
        puts back what it held when this patch was made."""
        original = getattr(owner, name)
        return cls(lambda: setattr(owner, name, replacement), lambda: setattr(owner, name, original))

    def active(self) -> bool:
        """Whether this thread is inside a capture."""
        return bool(getattr(self._thread, "depth", 0))

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._count == 0:
                self._apply()
            self._count += 1
        self._thread.depth = getattr(self._thread, "depth", 0) + 1
        try:
            yield
        finally:
            self._thread.depth -= 1
            with self._lock:
                self._count -= 1
                if self._count == 0:
                    self._restore()
