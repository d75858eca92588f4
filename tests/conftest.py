"""Shared test helpers: import the example programs as modules."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A captured model's memory format follows a rule on its convolutions (poptorch_compat.compile.memory_format);
# tests compare with eager NCHW, so they fix it to NCHW unless they set it themselves
# (tests/poptorch_compat/compile/test_memory_format.py). IPUXL_CHANNELS_LAST=1 runs the suite channels-last.
os.environ.setdefault("IPUXL_CHANNELS_LAST", "0")

# With pytest-xdist (`-n N`) the N workers share the machine's cores: each worker's torch (and the
# processes it starts) takes its share of threads, so N workers on N cores do not oversubscribe them.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` (the examples are scripts, not a package)."""
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"ipuxl_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def popxl_mnist() -> ModuleType:
    return load_example("popxl_mnist")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run the tests marked slow (CI=true runs them too)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a test of about 15 s or more: run in CI (CI=true) or with --runslow, "
                                       "skipped otherwise")


def runs_slow_tests(config: pytest.Config) -> bool:
    """Slow tests run in CI (``CI`` set to true, as CI services set it) or when asked with ``--runslow``."""
    return bool(config.getoption("--runslow")) or os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if runs_slow_tests(config):
        return
    skip = pytest.mark.skip(reason="slow: runs in CI (CI=true) or with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _compat_aliases_left_as_found() -> object:
    """A test that installs ``ipuxl.compat`` (``import poptorch``...) and leaves it installed would
    change later tests of the same process: a model wrapped while ``poptorch`` is imported keeps
    PopTorch's fixed-input contract (``poptorch_compat.runtime.call_inputs``)."""
    import ipuxl.compat

    installed = ipuxl.compat.is_installed()
    yield
    if not installed and ipuxl.compat.is_installed():
        ipuxl.compat.uninstall()
