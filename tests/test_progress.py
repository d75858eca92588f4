"""The compile progress bar (``ipuxl.progress``): PopTorch's "Graph compilation" bar on a terminal,
its switches, and a PopXL session's compile with its bar and log record."""
from __future__ import annotations

import contextlib
import io
import logging
import sys
from typing import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.log
import ipuxl.ops as ops
import ipuxl.progress
from ipuxl.poptorch_compat.compile.log import program_stages


class FakeTerminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.linear(x), y)


@pytest.fixture(autouse=True)
def restore_loggers():
    """Leave the ``ipuxl`` and PopTorch loggers as the test found them."""
    loggers = [logging.getLogger("ipuxl"), logging.getLogger("poptorch::python")]
    saved = [(lg.level, list(lg.handlers)) for lg in loggers]
    yield
    for lg, (level, handlers) in zip(loggers, saved):
        lg.setLevel(level)
        lg.handlers[:] = handlers


@pytest.fixture(autouse=True)
def bar_due_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar is due as the compile starts and not turned off by the environment."""
    monkeypatch.setattr(ipuxl.progress, "DELAY_S", 0.0)
    monkeypatch.delenv("IPUXL_PROGRESS", raising=False)


@contextlib.contextmanager
def on_terminal() -> Iterator[FakeTerminal]:
    """stderr is a terminal inside the block (set in the test body: pytest's capture
    replaces sys.stderr between a fixture's setup and the test's call)."""
    fake, real = FakeTerminal(), sys.stderr
    sys.stderr = fake
    try:
        yield fake
    finally:
        sys.stderr = real


def train_once(options: ipuxl.Options | None = None) -> None:
    """One call of a training model, checked against eager SGD (the bar must not change results)."""
    torch.manual_seed(0)
    model = Regression()
    w0, b0 = model.linear.weight.detach().clone(), model.linear.bias.detach().clone()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    training = ipuxl.trainingModel(model, options, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    loss = training(x, y)
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    expected = F.mse_loss(x @ w.T + b, y)
    expected.backward()
    assert_close(loss.reshape(()), expected.detach())
    assert_close(model.linear.weight.detach(), w0 - 0.1 * w.grad)
    training.destroy()


def test_first_call_shows_poptorchs_compilation_bar_on_a_terminal():
    with on_terminal() as terminal:
        train_once()
    out = terminal.getvalue()
    assert "Graph compilation:" in out
    stages = program_stages(True, ipuxl.Options().auto_outline)
    assert stages[:2] == ["capture", "autodiff"] and stages[-1] == "compile"
    assert all(name in out for name in stages)  # each stage shown while in progress
    final = out.replace("\r", "\n").strip().splitlines()[-1]
    assert "100%" in final and f"{len(stages)}/{len(stages)}" in final


@pytest.mark.parametrize("turn_off", ["option", "environment", "not a terminal", "fast compile"])
def test_no_bar_when_turned_off(monkeypatch: pytest.MonkeyPatch, turn_off: str):
    options = ipuxl.Options()
    if turn_off == "option":
        options.showCompilationProgressBar(False)
    elif turn_off == "environment":
        monkeypatch.setenv("IPUXL_PROGRESS", "0")
    elif turn_off == "fast compile":  # the bar waits for DELAY_S: a compile that ends sooner never shows it
        monkeypatch.setattr(ipuxl.progress, "DELAY_S", 600.0)
    with on_terminal() as terminal:
        if turn_off == "not a terminal":
            sys.stderr = io.StringIO()
        train_once(options)
        written = terminal.getvalue() + sys.stderr.getvalue()  # type: ignore[attr-defined]
    assert "Graph compilation" not in written


def test_progress_enabled_reads_option_environment_and_terminal(monkeypatch: pytest.MonkeyPatch):
    with on_terminal():
        assert ipuxl.progress.progress_enabled(True)
        assert not ipuxl.progress.progress_enabled(False)
        for off in ("0", "false", "OFF"):
            monkeypatch.setenv("IPUXL_PROGRESS", off)
            assert not ipuxl.progress.progress_enabled(True)
        monkeypatch.setenv("IPUXL_PROGRESS", "1")
        assert ipuxl.progress.progress_enabled(True)
        sys.stderr = io.StringIO()
        assert not ipuxl.progress.progress_enabled(True)


def build_session_ir() -> tuple[ipuxl.Ir, ipuxl.HostToDeviceStream, ipuxl.DeviceToHostStream]:
    ir = ipuxl.Ir()
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((2, 3), ipuxl.float32, "x")
        x = ops.host_load(x_stream)
        y_stream = ipuxl.d2h_stream((2, 3), ipuxl.float32, "y")
        ops.host_store(y_stream, ops.relu(x) * 2.0)
    return ir, x_stream, y_stream


def test_a_popxl_session_compile_has_its_own_bar_and_log(caplog: pytest.LogCaptureFixture):
    ir, x_stream, y_stream = build_session_ir()
    caplog.set_level(logging.INFO, logger="ipuxl")
    data = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
    with on_terminal() as terminal, ipuxl.Session(ir, "ipu_model") as session:
        y = session.run({x_stream: data})[y_stream]
    assert_close(torch.from_numpy(y), torch.relu(torch.from_numpy(data)) * 2.0)
    assert "Graph compilation:" in terminal.getvalue() and "1/1" in terminal.getvalue()
    [record] = [r for r in caplog.records if r.getMessage().startswith("compiled the session's IR")]
    n_ops = sum(1 for node in ir.main_graph.fx.nodes if node.op == "call_function")
    assert record.levelno == logging.INFO and f"1 graphs, {n_ops} ops (main_graph {n_ops})" in record.getMessage()


@pytest.mark.parametrize("enabled", [True, False], ids=["gc-on", "gc-off"])
def test_a_compile_pauses_the_cyclic_gc_and_restores_it(enabled: bool):
    """The outermost pipeline runs with the cyclic collector off; after it (even after a
    failed compile) the collector is as the caller left it, and nested pipelines change nothing."""
    import gc

    seen = []
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with ipuxl.progress.pipeline("outer", ["a"], show=False):
            seen.append(gc.isenabled())
            with ipuxl.progress.pipeline("inner", ["b"], show=False):
                seen.append(gc.isenabled())
            seen.append(gc.isenabled())
        seen.append(gc.isenabled())
        with pytest.raises(ZeroDivisionError):
            with ipuxl.progress.pipeline("failing", ["a"], show=False):
                1 / 0
        seen.append(gc.isenabled())
    finally:
        gc.enable() if was else gc.disable()
    assert seen == [False, False, False, enabled, enabled]
