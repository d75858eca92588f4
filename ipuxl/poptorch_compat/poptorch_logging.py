"""PopTorch's logging (``poptorch.logging`` / ``poptorch._logging``): its two loggers,
``setLogLevel`` and ``setPopartLogLevel``.

Upstream logs through two loggers, and so does ipuxl, with the same names, words and
levels:

* ``"poptorch::python"`` (``logger``): what PopTorch's Python front end logs
  ("Input tensor has requires_grad=True set. ...", "Using cached optimiser state
  dict", "Ignoring unexpected ... attribute" ...);
* ``"poptorch:cpp"`` (``cpp_logger``): what upstream's C++ backend logs where ipuxl
  does the same thing ("Updating graph optimizer with SGD, defaultLearningRate=0.01,
  ...", "Writing optimiser state tensors from IPU to host.", each option set with
  "poptorch.Options set ... to value ..."). Its ``TRACE`` level is 5 (below DEBUG).

Both print to the *current* ``sys.stderr`` (so ``capfd``/``capsys`` and redirections
see them) in upstream's layout, ``[HH:MM:SS.mmm] [poptorch::python] [warning]
message``, and both also propagate to the root logger (``caplog``,
``logging.basicConfig``), as upstream's do. The level names are upstream's
(``TRACE``, ``DEBUG``, ``INFO``, ``WARN``, ``ERR``, ``OFF``, and the legacy integers
0-4 and 6); the initial level is read from ``POPTORCH_LOG_LEVEL`` (default ``WARN``).
``Options.maxRepeatLogs(n)`` prints each message at most n times on the console
(``set_max_repeats``). ``setLogLevel`` also sets ipuxl's own ``"ipuxl"`` logger (``ipuxl.log``: compile
times, graph sizes, recompiles and why). Unlike upstream, no ``sys.excepthook`` is
installed. ipuxl has no PopART: ``setPopartLogLevel`` validates and records its level
(``popart_log_level()``), and nothing is logged under PopART's names.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys

from ipuxl.errors import InvalidValueError
from ipuxl.log import OFF as IPUXL_OFF, set_log_level as set_ipuxl_log_level

__all__ = ["logger", "cpp_logger", "setLogLevel", "setPopartLogLevel", "popart_log_level", "set_max_repeats", "TRACE"]

#: PopTorch's Python logger (upstream's name)
logger = logging.getLogger("poptorch::python")
#: the logger of what upstream's C++ backend logs (upstream's name)
cpp_logger = logging.getLogger("poptorch:cpp")

#: the C++ logger's TRACE level (below DEBUG; Python's logger logs TRACE as DEBUG, as upstream)
TRACE = 5

#: level name -> (upstream's integer level, Python logger level, C++ logger level)
_LEVELS: dict[str, tuple[int, int, int]] = {
    "TRACE": (0, logging.DEBUG, TRACE),
    "TRACE_ALL": (0, logging.DEBUG, TRACE),
    "DEBUG": (1, logging.DEBUG, logging.DEBUG),
    "DEBUG_IR": (1, logging.DEBUG, logging.DEBUG),
    "INFO": (2, logging.INFO, logging.INFO),
    "WARN": (3, logging.WARNING, logging.WARNING),
    "ERR": (4, logging.ERROR, logging.ERROR),
    "OFF": (6, logging.CRITICAL, IPUXL_OFF),
}
_PUBLIC = ("DEBUG", "ERR", "INFO", "OFF", "TRACE", "WARN")
_POPART_LEVELS = ("TRACE", "DEBUG", "INFO", "WARN", "ERR", "OFF")
_popart_level = os.environ.get("POPART_LOG_LEVEL", "WARN")


def setLogLevel(level: str | int) -> None:  # noqa: N802 - PopTorch's name
    """Set how much PopTorch logs: ``"TRACE"``, ``"DEBUG"``, ``"INFO"``, ``"WARN"``,
    ``"ERR"`` or ``"OFF"`` (or upstream's legacy integer for one of them).

    Raises:
        InvalidValueError: an unknown name ("Unknown log level: ...") or integer
            ("Invalid log level integer"): a ValueError, with upstream's words.
    """
    name = _name_of(level)
    _, python_level, cpp_level = _LEVELS[name]
    logger.setLevel(python_level)
    cpp_logger.setLevel(cpp_level)
    set_ipuxl_log_level(IPUXL_OFF if name == "OFF" else python_level)  # ipuxl's own diagnostics


def _name_of(level: object) -> str:
    if isinstance(level, int) and not isinstance(level, bool):
        for name, (number, _, _) in _LEVELS.items():
            if number == level:
                return name
        raise InvalidValueError("Invalid log level integer", fix=_FIX)
    if isinstance(level, str) and level in _LEVELS:
        return level
    raise InvalidValueError(f"Unknown log level: {level}. Valid values are " + ", ".join(_PUBLIC[:-1])
                            + f" and {_PUBLIC[-1]}", fix=_FIX)


_FIX = ("pass one of " + ", ".join(repr(n) for n in _PUBLIC) + " (or upstream's integer for one: "
        + ", ".join(f"{n}={_LEVELS[n][0]}" for n in _PUBLIC) + ")")


def setPopartLogLevel(level: str) -> None:  # noqa: N802 - PopTorch's (private) name
    """Set PopART's log level (upstream's ``poptorch._logging.setPopartLogLevel``).

    ipuxl has no PopART, so nothing is logged at any level; the level is validated as
    upstream and kept (``popart_log_level()``).

    Raises:
        InvalidValueError: ``level`` is not one of the level names (a ValueError).
    """
    global _popart_level
    if not isinstance(level, str) or level not in _POPART_LEVELS:
        raise InvalidValueError(f"Level must be one of {list(_POPART_LEVELS)}, got {level!r}",
                                fix="pass a level name, e.g. setPopartLogLevel(\"WARN\")")
    _popart_level = level


def popart_log_level() -> str:
    """The level last given to :func:`setPopartLogLevel` (else ``POPART_LOG_LEVEL``, else ``"WARN"``)."""
    return _popart_level


class _ConsoleFormatter(logging.Formatter):
    """Upstream's layout: ``[HH:MM:SS.mmm] [logger] [level] message``, the level in lower case."""

    _NAMES = {TRACE: "trace", logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning",
              logging.ERROR: "error", logging.CRITICAL: "critical"}

    def __init__(self) -> None:
        super().__init__("[%(asctime)s] [%(name)s] [%(level)s] %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's
        stamp = datetime.datetime.fromtimestamp(record.created)
        return f"{stamp:%H:%M:%S}.{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        record.level = self._NAMES.get(record.levelno, record.levelname.lower())
        return super().format(record)


class _RepeatFilter(logging.Filter):
    """Lets a message through at most ``limit`` times (None: always)."""

    def __init__(self) -> None:
        super().__init__()
        self.limit: int | None = None
        self.seen: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if self.limit is None:
            return True
        key = (record.name, record.getMessage())
        self.seen[key] = self.seen.get(key, 0) + 1
        return self.seen[key] <= self.limit


_REPEATS = _RepeatFilter()


def set_max_repeats(limit: int | None) -> None:
    """Print each PopTorch log message at most ``limit`` times on the console (None: no
    limit), as ``Options.maxRepeatLogs`` asks; the count starts again."""
    _REPEATS.limit, _REPEATS.seen = limit, {}


class _ConsoleHandler(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is when the record is logged (pytest's
    ``capfd``/``capsys`` and the user's redirections swap it), as upstream's console sink."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _install_console(target: logging.Logger) -> None:
    if not any(isinstance(h, _ConsoleHandler) for h in target.handlers):
        handler = _ConsoleHandler()
        handler.setFormatter(_ConsoleFormatter())
        handler.addFilter(_REPEATS)
        target.addHandler(handler)


for _logger in (logger, cpp_logger):
    _install_console(_logger)

# The initial level (``ipuxl.log`` reads ``POPTORCH_LOG_LEVEL`` for its own logger).
_, _python_level, _cpp_level = _LEVELS[_name_of(os.environ.get("POPTORCH_LOG_LEVEL", "WARN"))]
logger.setLevel(_python_level)
cpp_logger.setLevel(_cpp_level)
