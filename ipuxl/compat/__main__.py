"""``python -m ipuxl.compat PROGRAM.py [args]``: run a Graphcore program on ipuxl.

Installs the ``popxl``/``popxl_addons``/``poptorch`` aliases (``ipuxl.compat.install``),
then runs ``PROGRAM.py`` as ``__main__`` with ``sys.argv = [PROGRAM.py, *args]`` and
the program's folder first on ``sys.path``, as ``python PROGRAM.py args`` would.
``python -m ipuxl.compat -m MODULE [args]`` runs a module instead (as ``python -m``).
Under torchrun: ``torchrun --nproc_per_node P -m ipuxl.compat PROGRAM.py [args]``.

``python -m ipuxl.compat --install`` makes the names importable in every Python process
of the running interpreter's environment instead (``ipuxl.compat.environment``: a
``.pth`` file in its site-packages); ``--uninstall`` removes it.
"""
from __future__ import annotations

import os
import runpy
import sys

from ipuxl.compat import install

USAGE = ("usage: python -m ipuxl.compat PROGRAM.py [args ...]\n       python -m ipuxl.compat -m MODULE [args ...]\n"
         "       python -m ipuxl.compat --install | --uninstall   (every process of this environment)")


def main(argv: list[str]) -> int:
    """Run the program ``argv`` names; returns the exit status for usage errors."""
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] in ("--install", "--uninstall"):
        return _environment(argv[0])
    install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    program = argv[0]
    if not os.path.isfile(program):
        print(f"python -m ipuxl.compat: can't open file '{program}': no such file", file=sys.stderr)
        return 2
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(program))  # as `python PROGRAM.py` sets it
    runpy.run_path(program, run_name="__main__")
    return 0


def _environment(flag: str) -> int:
    """``--install``/``--uninstall``: write or remove the environment's start-up hook."""
    from ipuxl.compat.environment import install_environment, site_packages, uninstall_environment

    if flag == "--install":
        paths = install_environment()
        print(f"ipuxl.compat installed in {site_packages()} ({', '.join(p.name for p in paths)}): "
              "import poptorch/popxl/popxl_addons/popdist/popart now work in every Python process of this "
              "environment; 'python -m ipuxl.compat --uninstall' removes it")
    else:
        removed = uninstall_environment()
        print(f"ipuxl.compat uninstalled from {site_packages()}" if removed
              else f"ipuxl.compat was not installed in {site_packages()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
