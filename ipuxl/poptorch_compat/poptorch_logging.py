"""PopTorch's logging (``poptorch.logging`` / ``poptorch._logging``): the
``"poptorch::python"`` logger and ``setLogLevel``.

The level names are upstream's (``TRACE``, ``DEBUG``, ``INFO``, ``WARN``, ``ERR``,
``OFF``, and the legacy integers 0-6); the initial level is read from
``POPTORCH_LOG_LEVEL`` (default ``WARN``), as upstream. ipuxl has no C++ backend: its
compiler's diagnostics (compile times, graph sizes, recompiles and why, each pass) go
to the ``"ipuxl"`` logger (``ipuxl.log``), and ``setLogLevel`` sets that logger's level
too (``POPTORCH_LOG_LEVEL`` is read by ``ipuxl.log`` when ``IPUXL_LOG_LEVEL`` is unset).
Unlike upstream, importing this module installs no console handler and no
``sys.excepthook``: the logger propagates to the root logger like any library's.
"""
from __future__ import annotations

import logging
import os

from ipuxl.errors import InvalidValueError
from ipuxl.log import OFF as IPUXL_OFF, set_log_level as set_ipuxl_log_level

__all__ = ["logger", "setLogLevel"]

#: PopTorch's logger (upstream's name)
logger = logging.getLogger("poptorch::python")

#: level name -> (upstream's integer level, Python logging level)
_LEVELS: dict[str, tuple[int, int]] = {
    "TRACE": (0, logging.DEBUG),
    "TRACE_ALL": (0, logging.DEBUG),
    "DEBUG": (1, logging.DEBUG),
    "DEBUG_IR": (1, logging.DEBUG),
    "INFO": (2, logging.INFO),
    "WARN": (3, logging.WARNING),
    "ERR": (4, logging.ERROR),
    "OFF": (6, logging.CRITICAL),
}
_PUBLIC = ("DEBUG", "ERR", "INFO", "OFF", "TRACE", "WARN")


def setLogLevel(level: str | int) -> None:  # noqa: N802 - PopTorch's name
    """Set how much PopTorch logs: ``"TRACE"``, ``"DEBUG"``, ``"INFO"``, ``"WARN"``,
    ``"ERR"`` or ``"OFF"`` (or upstream's legacy integer for one of them).

    Raises:
        InvalidValueError: an unknown name or integer (a ValueError, as upstream).
    """
    name = _name_of(level)
    logger.setLevel(_LEVELS[name][1])
    set_ipuxl_log_level(IPUXL_OFF if name == "OFF" else _LEVELS[name][1])  # ipuxl's own diagnostics


def _name_of(level: object) -> str:
    if isinstance(level, int) and not isinstance(level, bool):
        for name, (number, _) in _LEVELS.items():
            if number == level:
                return name
        raise InvalidValueError(f"setLogLevel: invalid log level integer {level}", fix=_FIX)
    if isinstance(level, str) and level in _LEVELS:
        return level
    raise InvalidValueError(f"setLogLevel: unknown log level {level!r}", fix=_FIX)


_FIX = ("pass one of " + ", ".join(repr(n) for n in _PUBLIC) + " (or upstream's integer for one: "
        + ", ".join(f"{n}={_LEVELS[n][0]}" for n in _PUBLIC) + ")")


logger.setLevel(_LEVELS[_name_of(os.environ.get("POPTORCH_LOG_LEVEL", "WARN"))][1])  # ``ipuxl.log`` maps it too
