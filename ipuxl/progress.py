"""Compile progress: PopTorch's "Graph compilation" bar, and each stage's time in the log.

A compile is a :func:`pipeline` of named stages; the code inside it marks each stage
with :func:`stage`. The bar (tqdm, PopTorch's format: ``Graph compilation: 50%|####
| 1/2 [00:03<00:03]``) appears only when the compile takes longer than
:data:`DELAY_S` (about a second): a watcher thread opens it then and keeps its clock
ticking during a long stage. It is shown only when all of these allow it:

- the caller's switch (``Options.showCompilationProgressBar``, PopTorch's name);
- the environment: ``IPUXL_PROGRESS=0`` (or ``false``/``off``) turns it off;
- stderr is a terminal (no bar in logs, pipes or CI).

Pipelines nest: a :func:`pipeline` opened inside another (a ``Session`` compiled by
``trainingModel``) adds its stages to the outer one and neither opens a bar nor logs a
summary of its own. Each stage logs its time at DEBUG and the outermost pipeline its
total at INFO (``ipuxl.log``), bar or not.

The outermost pipeline also pauses Python's cyclic garbage collector (``paused_gc``): a
compile allocates millions of short-lived objects (fx nodes, fake tensors), and the
collections they trigger each walk every object alive, torch's included (a tenth of
ResNet-50's first call). Refcounting still frees what is not in a cycle; the cycles
made meanwhile wait for the first collection after the compile.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from tqdm import tqdm

from ipuxl.log import logger

__all__ = ["DELAY_S", "BAR_FORMAT", "Pipeline", "pipeline", "stage", "progress_enabled", "graph_sizes",
           "paused_gc"]

#: seconds a compile runs before its bar appears
DELAY_S = 1.0
#: how often the open bar's clock is redrawn during a stage, in seconds
REFRESH_S = 0.25
#: PopTorch's bar: no rate, elapsed and remaining time
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
DESCRIPTION = "Graph compilation"

_OFF_VALUES = ("0", "false", "off", "no")
_active: list["Pipeline"] = []  # the open pipelines, outermost first (one compile at a time per process)


def progress_enabled(show: bool = True) -> bool:
    """Whether a compile may show its bar: ``show`` (the user's option), ``IPUXL_PROGRESS``
    not off, and stderr a terminal."""
    if not show or os.environ.get("IPUXL_PROGRESS", "1").strip().lower() in _OFF_VALUES:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Pipeline:
    """One compile: its stages in order, their times, and the bar once it is due.

    Attributes:
        what: what is compiled, for the log (``"the training model"``).
        stages: the stage names, in order; the bar counts the ones finished.
        times: seconds each finished stage took, in finishing order.
    """

    def __init__(self, what: str, stages: Iterable[str], show: bool):
        self.what = what
        self.stages = list(stages)
        self.times: dict[str, float] = {}
        self.started = time.perf_counter()
        self._done = 0
        self._current = ""
        self._bar: tqdm | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._show = show
        self._watcher: threading.Thread | None = None
        if show:
            self._watcher = threading.Thread(target=self._watch, name="ipuxl-compile-progress", daemon=True)
            self._watcher.start()

    @property
    def elapsed(self) -> float:
        """Seconds since the pipeline started."""
        return time.perf_counter() - self.started

    def begin(self, name: str) -> None:
        """Stage ``name`` starts: the bar shows its name."""
        with self._lock:
            self._current = name
            self._open_if_due()
            if self._bar is not None:
                self._bar.set_postfix_str(name, refresh=True)

    def end(self, name: str, seconds: float) -> None:
        """Stage ``name`` ended after ``seconds``: the bar counts every stage up to it."""
        self.times[name] = self.times.get(name, 0.0) + seconds
        logger.debug("%s: stage %s took %.3f s", self.what, name, seconds)
        with self._lock:
            if name in self.stages:
                self._done = max(self._done, self.stages.index(name) + 1)
            self._open_if_due()
            if self._bar is not None:
                self._bar.update(self._done - self._bar.n)

    def close(self, completed: bool) -> None:
        """Stop the watcher; a completed compile fills its bar before it closes."""
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join()
        with self._lock:
            if completed:
                self._open_if_due()  # a compile that ran past DELAY_S shows its full bar at least
            if self._bar is not None:
                if completed:
                    self._bar.update(len(self.stages) - self._bar.n)
                self._bar.set_postfix_str("", refresh=False)
                self._bar.close()
                self._bar = None

    def summary(self) -> str:
        """``capture 0.10 s, compile 0.31 s``: the stages' times."""
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.times.items())

    def _open_if_due(self) -> None:
        """Open the bar once the compile has run for DELAY_S (called holding the lock)."""
        if not self._show or self._bar is not None or self.elapsed < DELAY_S:
            return
        self._bar = tqdm(desc=DESCRIPTION, total=len(self.stages), initial=self._done, bar_format=BAR_FORMAT,
                         file=sys.stderr, leave=True, dynamic_ncols=True)
        if self._current:
            self._bar.set_postfix_str(self._current, refresh=False)
        self._bar.refresh()

    def _watch(self) -> None:
        """Open the bar when it is due, even in the middle of a long stage, and keep its clock ticking."""
        if self._closed.wait(DELAY_S):
            return
        with self._lock:
            if not self._closed.is_set():
                self._open_if_due()
        while not self._closed.wait(REFRESH_S):
            with self._lock:
                if self._bar is not None:
                    self._bar.refresh()


@contextlib.contextmanager
def pipeline(what: str, stages: Iterable[str], *, show: bool = True,
             sizes: Callable[[], str] | None = None) -> Iterator[Pipeline]:
    """Run a compile of ``stages`` (see the module docstring); inside another pipeline,
    the outer one.

    Args:
        what: what is compiled, for the log.
        stages: the names its :func:`stage` calls will use, in order.
        show: the user's option for the bar (:func:`progress_enabled` decides).
        sizes: called once the compile succeeded, for the INFO summary (graph sizes).

    Example:
        >>> with pipeline("the IR", ["lower"], show=False):
        ...     with stage("lower"):
        ...         pass
    """
    if _active:
        yield _active[0]
        return
    current = Pipeline(what, stages, progress_enabled(show))
    _active.append(current)
    completed = False
    try:
        with paused_gc():
            yield current
        completed = True
    finally:
        _active.remove(current)
        current.close(completed)
    if logger.isEnabledFor(logging.INFO):
        size = f": {sizes()}" if sizes is not None else ""
        logger.info("compiled %s in %.2f s (%s)%s", what, current.elapsed, current.summary(), size)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (as it was before, after: a caller that
    turned it off keeps it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Mark a stage of the current compile: timed, logged at DEBUG, counted by the bar.
    Outside any :func:`pipeline` it is only timed and logged."""
    owner = _active[0] if _active else None
    if owner is not None:
        owner.begin(name)
    started = time.perf_counter()
    yield
    seconds = time.perf_counter() - started
    if owner is not None:
        owner.end(name, seconds)
    else:
        logger.debug("stage %s took %.3f s", name, seconds)


def graph_sizes(graphs: Iterable[Any]) -> str:
    """``3 graphs, 57 ops (main 12, ...)``: each IR graph's op count (its fx graph's calls)."""
    counts = {graph.name: sum(1 for node in graph.fx.nodes if node.op == "call_function") for graph in graphs}
    largest = sorted(counts.items(), key=lambda item: -item[1])[:4]
    listed = ", ".join(f"{name} {count}" for name, count in largest)
    more = ", ..." if len(counts) > len(largest) else ""
    return f"{len(counts)} graphs, {sum(counts.values())} ops ({listed}{more})"
