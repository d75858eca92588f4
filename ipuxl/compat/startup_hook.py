"""The import hook ``python -m ipuxl.compat --install`` puts in every Python process of an environment.

``ipuxl.compat.environment`` copies this file into the environment's site-packages as
``_ipuxl_compat.py``, beside ``ipuxl_compat.pth`` (one line: ``import _ipuxl_compat;
_ipuxl_compat.activate()``), so Python runs it at start-up (``site``), in every process: a script, pytest, a Jupyter
kernel, a subprocess. It uses only the standard library and imports nothing of ipuxl
(or torch) until a program asks for one of Graphcore's packages: it puts a small finder
first on ``sys.meta_path`` that, on the first ``import poptorch`` (or ``popxl``,
``popxl_addons``, ``popdist``, ``popart``, or ``importlib.util.find_spec`` of one, as
clients test availability), imports ``ipuxl.compat``, calls ``install()`` and hands the
lookup to its finder. Without ipuxl importable (uninstalled) it finds nothing, and
``IPUXL_COMPAT=0`` in a process's environment turns it off there.
"""
from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any, Sequence

#: Graphcore's packages that ipuxl.compat stands in for (``ipuxl.compat.table.ROOTS``)
ROOTS = ("popxl", "popxl_addons", "poptorch", "popdist", "popart")


class LazyCompatFinder(importlib.abc.MetaPathFinder):
    """Installs ``ipuxl.compat`` on the first lookup of one of ``ROOTS``, then steps aside."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: Any = None) -> Any:
        if fullname.partition(".")[0] not in ROOTS or os.environ.get("IPUXL_COMPAT", "1") == "0":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # ipuxl.compat's own finder answers from now on
        try:
            import ipuxl.compat as compat
        except ImportError:
            return None  # ipuxl is gone: the names are simply not there
        compat.install()
        return compat.CompatFinder().find_spec(fullname, path, target)


def activate() -> None:
    """Put a ``LazyCompatFinder`` first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, LazyCompatFinder) or type(f).__name__ == "CompatFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, LazyCompatFinder())
