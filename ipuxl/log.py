"""ipuxl's logger: ``logging.getLogger("ipuxl")``, its level set by ``IPUXL_LOG_LEVEL``.

What is logged:

- INFO: each compile (what was compiled, for which inputs, how long each stage took,
  how many graphs and ops the program has) and each recompile with its reason (an
  input's shape changed, the optimiser changed);
- DEBUG: each stage of a compile (capture, autodiff, outline, compile...) as it ends,
  with its time.

The level comes from ``IPUXL_LOG_LEVEL``, else from PopTorch's ``POPTORCH_LOG_LEVEL``
(read once, when ipuxl is imported), or from :func:`set_log_level`
(``poptorch.setLogLevel`` maps onto it). Names: Python's (``DEBUG``, ``INFO``,
``WARNING``, ``ERROR``, ``CRITICAL``) and PopTorch's (``TRACE``, ``WARN``, ``ERR``,
``OFF``), in any case. Left unset, ipuxl behaves as a library: no handler, the
logger inherits the root logger's level. Once a level is set, records also go to
stderr as ``ipuxl: INFO: ...``, unless the root logger has handlers of its own
(``logging.basicConfig``, pytest's ``caplog``): records always propagate there.

Example:
    $ IPUXL_LOG_LEVEL=INFO python train.py
    ipuxl: INFO: compiled the training model for inputs [16, 784] float32, [16] int64 in 0.42 s ...
"""
from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

from ipuxl.errors import InvalidValueError

__all__ = ["logger", "set_log_level", "level_of", "level_from_environment", "OFF"]

#: the package's logger; modules log to it or to a child (``ipuxl.<module>``)
logger = logging.getLogger("ipuxl")

#: a level above CRITICAL: nothing is logged
OFF = logging.CRITICAL + 10

_LEVELS: dict[str, int] = {
    "TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
    "WARNING": logging.WARNING, "ERR": logging.ERROR, "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL,
    "OFF": OFF,
}


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr``, and only while the root logger has no
    handlers (when it has, the record reaches them by propagation)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        self.stream = sys.stderr  # as it is now: pytest and users swap it
        with tqdm.external_write_mode(file=sys.stderr):  # above an open progress bar, not through it
            super().emit(record)


_HANDLER = _StderrHandler()
_HANDLER.setFormatter(logging.Formatter("ipuxl: %(levelname)s: %(message)s"))


def level_of(level: str | int) -> int:
    """The Python logging level of a level name (see the module docstring) or number.

    Raises:
        InvalidValueError: an unknown name, or a number that is not a logging level.
    """
    if isinstance(level, int) and not isinstance(level, bool):
        if level < 0:
            raise InvalidValueError(f"invalid log level {level}", fix=_FIX)
        return level
    if isinstance(level, str) and level.strip().upper() in _LEVELS:
        return _LEVELS[level.strip().upper()]
    raise InvalidValueError(f"unknown log level {level!r}", fix=_FIX)


_FIX = "use one of " + ", ".join(_LEVELS) + " (any case), or a logging level number such as logging.INFO"


def set_log_level(level: str | int) -> None:
    """Set how much ipuxl logs (``"DEBUG"``, ``"INFO"``, ``"WARN"``, ``"OFF"``...; see the
    module docstring), and show its records on stderr when nothing else does.

    Raises:
        InvalidValueError: an unknown level.

    Example:
        >>> import ipuxl.log
        >>> ipuxl.log.set_log_level("INFO")   # compile times, graph sizes, recompiles
    """
    logger.setLevel(level_of(level))
    if _HANDLER not in logger.handlers:
        logger.addHandler(_HANDLER)


def level_from_environment() -> None:
    """Apply ``IPUXL_LOG_LEVEL`` (else ``POPTORCH_LOG_LEVEL``), as importing ipuxl does; a bad
    value is logged as a warning and ignored, not raised."""
    for variable in ("IPUXL_LOG_LEVEL", "POPTORCH_LOG_LEVEL"):
        value = os.environ.get(variable)
        if value:
            try:
                set_log_level(value)
            except InvalidValueError as error:
                logger.warning("%s=%r ignored: %s", variable, value, error.what)
            return


level_from_environment()
