"""PopTorch's logger (``ipuxl.poptorch_compat.poptorch_logging``): ``setLogLevel``, upstream's
level names and legacy integers, and ``POPTORCH_LOG_LEVEL``."""
from __future__ import annotations

import logging

import pytest

import ipuxl.poptorch_compat as poptorch


@pytest.fixture
def restore_level():
    logger = logging.getLogger("poptorch::python")
    level = logger.level
    yield logger
    logger.setLevel(level)


@pytest.mark.parametrize("name, level", [("TRACE", logging.DEBUG), ("DEBUG", logging.DEBUG),
                                         ("INFO", logging.INFO), ("WARN", logging.WARNING),
                                         ("ERR", logging.ERROR), ("OFF", logging.CRITICAL)])
def test_set_log_level_sets_the_poptorch_logger(restore_level, name, level):
    poptorch.setLogLevel(name)
    assert poptorch.logger is restore_level and restore_level.level == level
    assert poptorch.logging.logger is poptorch.logger and poptorch.logging.setLogLevel is poptorch.setLogLevel


def test_set_log_level_takes_upstreams_legacy_integers(restore_level):
    poptorch.setLogLevel(4)
    assert restore_level.level == logging.ERROR
    poptorch.setLogLevel(2)
    assert restore_level.level == logging.INFO


@pytest.mark.parametrize("bad, fragment", [
    ("LOUD", "Unknown log level: LOUD. Valid values are DEBUG, ERR, INFO, OFF, TRACE and WARN"),
    (5, "Invalid log level integer"), (None, "Unknown log level: None")])
def test_set_log_level_refuses_unknown_levels_with_a_value_error(restore_level, bad, fragment):
    before = restore_level.level
    with pytest.raises(ValueError, match=fragment) as info:
        poptorch.setLogLevel(bad)
    assert "'WARN'" in info.value.fix and restore_level.level == before


def test_log_level_is_read_from_the_environment_at_import(tmp_path):
    import subprocess
    import sys

    code = ("import logging, ipuxl.poptorch_compat as p; "
            "print(p.logger.level, logging.getLogger('poptorch::python').level)")
    env_level = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                               env={**__import__("os").environ, "POPTORCH_LOG_LEVEL": "DEBUG"})
    assert env_level.returncode == 0, env_level.stderr
    assert env_level.stdout.split() == [str(logging.DEBUG)] * 2
