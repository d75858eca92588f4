"""The ``ipuxl`` logger (``ipuxl.log``): what a compile logs (recompile reasons, stage times), levels
and PopTorch's ``setLogLevel``, the level from the environment."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.log
import ipuxl.progress
from ipuxl.errors import InvalidValueError
from ipuxl.poptorch_compat import setLogLevel

from tests.conftest import ROOT
from tests.test_progress import Regression, train_once
from tests.test_progress import bar_due_at_once, restore_loggers  # noqa: F401 - the same autouse fixtures


def test_recompile_reason_is_logged(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG, logger="ipuxl")
    torch.manual_seed(0)
    model = Regression()
    inference = ipuxl.inferenceModel(model)
    for batch in (8, 16):
        x, y = torch.randn(batch, 4), torch.randn(batch, 2)
        assert_close(inference(x, y).reshape(()), F.mse_loss(model.linear(x), y).detach())
    messages = [r.getMessage() for r in caplog.records if r.name == "ipuxl"]
    compiled = [m for m in messages if m.startswith("compiled the inference model")]
    assert [m.split(" in ")[0] for m in compiled] == [
        "compiled the inference model for inputs [8, 4] float32, [8, 2] float32",
        "compiled the inference model for inputs [16, 4] float32, [16, 2] float32"]
    assert all("capture" in m and "compile" in m and " graphs, " in m and " ops (" in m for m in compiled)
    [reason] = [m for m in messages if m.startswith("recompiling")]
    assert reason == ("recompiling the inference model: input 'x' shape changed from [8, 4] to [16, 4] (per "
                      "micro-batch); input 'y' shape changed from [8, 2] to [16, 2] (per micro-batch)")
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("stage capture took" in m for m in debug) and any("stage compile took" in m for m in debug)
    assert inference.compile_count == 2


def test_an_optimizer_change_that_recompiles_is_logged(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="ipuxl")
    model = Regression()
    training = ipuxl.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    training(x, y)
    training.setOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    training(x, y)
    assert training.compile_count == 2
    assert any(r.getMessage().startswith("recompiling the training model: the optimizer changed")
               for r in caplog.records)
    training.destroy()


def test_no_log_below_the_level(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="ipuxl")
    train_once()
    assert [r for r in caplog.records if r.name == "ipuxl"] == []


def test_level_names_and_poptorchs_set_log_level():
    assert ipuxl.log.level_of("warn") == ipuxl.log.level_of("WARNING") == logging.WARNING
    assert ipuxl.log.level_of("TRACE") == logging.DEBUG and ipuxl.log.level_of(" Info ") == logging.INFO
    assert ipuxl.log.level_of("OFF") > logging.CRITICAL and ipuxl.log.level_of(15) == 15
    with pytest.raises(InvalidValueError, match="unknown log level 'LOUD'") as info:
        ipuxl.log.set_log_level("LOUD")
    assert isinstance(info.value, ValueError) and "TRACE" in (info.value.fix or "")
    setLogLevel("INFO")  # PopTorch's setter maps onto the ipuxl logger
    assert logging.getLogger("ipuxl").level == logging.INFO
    setLogLevel(4)  # upstream's legacy integer for ERR
    assert logging.getLogger("ipuxl").level == logging.ERROR
    setLogLevel("OFF")
    assert not logging.getLogger("ipuxl").isEnabledFor(logging.CRITICAL)


@pytest.mark.parametrize("env, level", [({"IPUXL_LOG_LEVEL": "info"}, logging.INFO),
                                        ({"POPTORCH_LOG_LEVEL": "TRACE"}, logging.DEBUG),
                                        ({"IPUXL_LOG_LEVEL": "ERR", "POPTORCH_LOG_LEVEL": "DEBUG"}, logging.ERROR)])
def test_log_level_from_the_environment(monkeypatch: pytest.MonkeyPatch, env: dict, level: int):
    monkeypatch.delenv("IPUXL_LOG_LEVEL", raising=False)
    monkeypatch.delenv("POPTORCH_LOG_LEVEL", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ipuxl.log.level_from_environment()
    assert logging.getLogger("ipuxl").level == level  # IPUXL_LOG_LEVEL wins over PopTorch's variable


def test_a_bad_log_level_in_the_environment_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture):
    monkeypatch.setenv("IPUXL_LOG_LEVEL", "LOUD")
    before = logging.getLogger("ipuxl").level
    ipuxl.log.level_from_environment()
    assert logging.getLogger("ipuxl").level == before
    assert "IPUXL_LOG_LEVEL='LOUD' ignored: unknown log level 'LOUD'" in caplog.text


def test_ipuxl_log_level_shows_records_on_stderr():
    """End to end, in a fresh process (the variable is read at import): no logging set up by
    the program, yet the records reach stderr."""
    code = ("import numpy as np, ipuxl, ipuxl.ops as ops\n"
            "ir = ipuxl.Ir()\n"
            "with ir.main_graph:\n"
            "    ops.host_store(ipuxl.d2h_stream((2,), ipuxl.float32, 'y'), ipuxl.constant(np.ones(2, np.float32)))\n"
            "ipuxl.Session(ir, 'cpu')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("IPUXL_LOG_LEVEL", "POPTORCH_LOG_LEVEL")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**env, "IPUXL_LOG_LEVEL": "debug", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "ipuxl: DEBUG: the session's IR: stage compile took" in done.stderr
    assert "ipuxl: INFO: compiled the session's IR in " in done.stderr
