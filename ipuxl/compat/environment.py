"""``python -m ipuxl.compat --install``: Graphcore's import names in every process of an environment.

``install_environment()`` writes two files into the running interpreter's site-packages
(a venv's own, when run from one):

* ``_ipuxl_compat.py``, a copy of ``ipuxl.compat.startup_hook``;
* ``ipuxl_compat.pth``, the line ``import _ipuxl_compat; _ipuxl_compat.activate()``, which
  Python's ``site`` runs at every start-up.

From then on ``import poptorch`` (``popxl``, ``popxl_addons``, ``popdist``, ``popart``) and
``importlib.util.find_spec("poptorch")`` work in every Python process of that
environment, with no ``python -m ipuxl.compat`` in front: scripts, pytest, Jupyter
kernels, Lightning programs and the subprocesses they start. Start-up stays cheap:
ipuxl is imported only when one of those names is. ``uninstall_environment()``
(``--uninstall``) removes both files. Processes started with ``python -S`` (no ``site``)
do not get the names; ``IPUXL_COMPAT=0`` turns them off in one process.
"""
from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

__all__ = ["install_environment", "uninstall_environment", "site_packages", "PTH_NAME", "HOOK_NAME"]

PTH_NAME = "ipuxl_compat.pth"
HOOK_NAME = "_ipuxl_compat.py"
_HOOK_SOURCE = Path(__file__).with_name("startup_hook.py")


def site_packages() -> Path:
    """The running interpreter's site-packages (``sysconfig``'s ``purelib``: a venv's own in a venv)."""
    return Path(sysconfig.get_paths()["purelib"])


def install_environment(target: str | os.PathLike[str] | None = None) -> list[Path]:
    """Write the hook and its ``.pth`` file into ``target`` (default: ``site_packages()``).

    Idempotent: a second call rewrites the same two files (with this ipuxl's hook).

    Returns:
        The two paths written.
    """
    folder = Path(target) if target is not None else site_packages()
    folder.mkdir(parents=True, exist_ok=True)
    hook, pth = folder / HOOK_NAME, folder / PTH_NAME
    shutil.copyfile(_HOOK_SOURCE, hook)
    module = Path(HOOK_NAME).stem
    pth.write_text(f"import {module}; {module}.activate()\n")
    return [hook, pth]


def uninstall_environment(target: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the files ``install_environment`` wrote (those present).

    Returns:
        The paths removed (empty when it was not installed there).
    """
    folder = Path(target) if target is not None else site_packages()
    removed = []
    for path in (folder / PTH_NAME, folder / HOOK_NAME):
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed
