"""PopTorch's loggers print to the console in upstream's layout, and the messages
PopTorch logs for what ipuxl does too (compile options, detached inputs)."""
from __future__ import annotations

import logging
import re

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.poptorch_compat import poptorch_logging

_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\.\d{3}\] \[(?P<name>[^\]]+)\] \[(?P<level>[a-z]+)\] (?P<message>.*)$")


@pytest.fixture
def levels():
    """Restore PopTorch's log levels and the repeat limit after a test."""
    loggers = [poptorch_logging.logger, poptorch_logging.cpp_logger, logging.getLogger("ipuxl")]
    before = [lg.level for lg in loggers]
    yield
    for lg, level in zip(loggers, before):
        lg.setLevel(level)
    poptorch_logging.set_max_repeats(None)


def _lines(text: str) -> list[dict[str, str]]:
    return [m.groupdict() for m in map(_LINE.match, text.splitlines()) if m]


def test_records_print_on_the_current_stderr_in_upstreams_layout(capfd, levels):
    poptorch.setLogLevel("DEBUG")
    poptorch_logging.logger.warning("first %s", "message")
    poptorch_logging.cpp_logger.debug("second")
    lines = _lines(capfd.readouterr().err)
    assert {"name": "poptorch::python", "level": "warning", "message": "first message"} in lines
    assert {"name": "poptorch:cpp", "level": "debug", "message": "second"} in lines


def test_the_cpp_logger_has_a_trace_level_below_debug(capfd, levels):
    poptorch.setLogLevel("DEBUG")
    poptorch_logging.cpp_logger.log(poptorch_logging.TRACE, "hidden")
    poptorch.setLogLevel("TRACE")
    poptorch_logging.cpp_logger.log(poptorch_logging.TRACE, "shown")
    lines = _lines(capfd.readouterr().err)
    assert [line["message"] for line in lines] == ["shown"] and lines[0]["level"] == "trace"


def test_set_log_level_messages_are_upstreams(levels):
    with pytest.raises(ValueError, match="^Invalid log level integer"):
        poptorch.setLogLevel(5)
    with pytest.raises(ValueError, match="Unknown log level: wibble. Valid values are DEBUG, ERR, INFO, OFF, TRACE "
                                         "and WARN"):
        poptorch.setLogLevel("wibble")


def test_popart_log_level_is_checked_and_kept(levels):
    poptorch_logging.setPopartLogLevel("DEBUG")
    assert poptorch_logging.popart_log_level() == "DEBUG"
    for bad in (0, "FOO"):
        with pytest.raises(ValueError, match="Level must be one of"):
            poptorch_logging.setPopartLogLevel(bad)
    poptorch_logging.setPopartLogLevel("WARN")


def test_max_repeat_logs_limits_a_repeated_message(capfd, levels):
    poptorch.Options().maxRepeatLogs(2)
    for _ in range(4):
        poptorch_logging.logger.warning("again")
    poptorch_logging.logger.warning("other")
    messages = [line["message"] for line in _lines(capfd.readouterr().err)]
    assert messages == ["again", "again", "other"]
    with pytest.raises(ValueError, match="maxRepeatLogs"):
        poptorch.Options().maxRepeatLogs(-1)


def test_an_input_requiring_grad_is_reported_when_compiled(caplog, levels):
    model = poptorch.inferenceModel(torch.nn.Linear(1, 1))
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        model(torch.tensor([[0.0]], requires_grad=True))
        model(torch.tensor([[1.0]], requires_grad=True))  # the same program: not compiled again
    messages = [r.getMessage() for r in caplog.records if r.name == "poptorch::python"]
    assert messages == ["Input tensor has requires_grad=True set. This tensor will be detached because backward "
                        "pass via inputs is not supported."]


def test_a_compile_logs_each_option_as_upstreams_backend(caplog, levels):
    opts = poptorch.Options().deviceIterations(1).setExecutionStrategy(poptorch.ShardedExecution())
    opts.enableSyntheticData(True)
    poptorch.setLogLevel("DEBUG")
    with caplog.at_level(logging.DEBUG, logger="poptorch:cpp"):
        poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)(torch.ones(1, 2))
    lines = {r.getMessage() for r in caplog.records if r.name == "poptorch:cpp"}
    assert {"poptorch.Options set replication_factor to value 1", "poptorch.Options set device_iterations to value 1",
            "poptorch.Options set execution_mode to value 1",
            "poptorch.Options set syntheticDataMode to value 2"} <= lines


def test_a_compile_skips_an_unknown_popart_option_with_a_warning(caplog, levels):
    opts = poptorch.Options()
    opts._Popart.set("notAPopartOption", 3)
    with caplog.at_level(logging.WARNING, logger="poptorch:cpp"):
        out = poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)(torch.ones(1, 2))
    assert out.shape == (1, 2)
    assert any("notAPopartOption" in r.getMessage() for r in caplog.records)
