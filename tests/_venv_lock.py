"""One test process at a time makes a venv: under xdist every worker imports the test
modules that make one, and two ``pip install``s into the same venv at once can break it
(the tests would then skip as if offline)."""
from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def venv_lock(venv: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``venv`` (made if missing) for the ``with`` block."""
    venv.mkdir(parents=True, exist_ok=True)
    with open(venv / ".ipuxl-lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
