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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a test of a minute or more (still run in CI; deselect with -m 'not slow')")
