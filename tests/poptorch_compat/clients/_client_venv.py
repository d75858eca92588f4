"""The interpreters the PopTorch clients run in: a venv of the clone's own per client, made on first use.

PyTorch Lightning 2.0.x imports ``pkg_resources`` (setuptools < 81, where the test
environment has a newer setuptools) and optimum-graphcore pins an older
``transformers`` than ipuxl's own tests use, so neither can go in the test extras
beside the global packages. Each client gets a venv over this interpreter's packages
(``--system-site-packages``: torch, numpy... are shared) with the client's packages
(``REQUIREMENTS``), made once in ``.venv-<client>`` at the clone's root (ignored by git),
with ``python -m ipuxl.compat --install`` run in it: the clients then ``import poptorch``
as they would on an IPU machine. ``IPUXL_<CLIENT>_PYTHON`` names another interpreter.
Offline, the venv cannot be made: the tests skip, saying what is missing.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests._venv_lock import venv_lock

ROOT = Path(__file__).resolve().parents[3]

#: client -> the pip installs that make its venv, in order (a list of argument lists)
REQUIREMENTS: dict[str, list[list[str]]] = {
    "lightning": [["pytorch-lightning==2.0.6", "lightning-graphcore==0.1.0", "setuptools>=77.0.3,<81"]],
    # optimum-graphcore's own requirements pull datasets/diffusers releases whose newest
    # versions conflict with transformers 4.29.2: install the packages it imports, then it
    # and optimum without their dependency lists
    "optimum": [["transformers==4.29.2", "tokenizers==0.13.3", "huggingface_hub==0.36.2", "typeguard", "sentencepiece",
                 "cppimport==22.8.2"],
                ["--no-deps", "optimum-graphcore==0.7.1", "optimum==1.6.1", "diffusers==0.12.1"]],
}
#: client -> a module that must import in its interpreter
PROBE = {"lightning": "lightning_graphcore", "optimum": "optimum.graphcore"}


def environment() -> dict[str, str]:
    """The environment a client runs in: this clone's ipuxl first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def client_python(client: str) -> tuple[str, str | None]:
    """``(interpreter, problem)``: the interpreter for ``client`` and why it cannot run it (None: it can)."""
    explicit = os.environ.get(f"IPUXL_{client.upper()}_PYTHON")
    python = explicit or _venv(client)
    probe = ("import importlib, importlib.util; importlib.import_module(%r); "
             "assert importlib.util.find_spec('poptorch') is not None, 'no poptorch'") % PROBE[client]
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=600, env=environment())
    except (OSError, subprocess.SubprocessError) as error:
        return python, f"cannot run {python}: {error}"
    if found.returncode != 0:
        last = (found.stderr.strip().splitlines() or ["?"])[-1]
        return python, (f"{python} cannot import {PROBE[client]} and poptorch ({last}); set "
                        f"IPUXL_{client.upper()}_PYTHON to a Python with {' '.join(REQUIREMENTS[client][0])}")
    return python, None


def _venv(client: str) -> str:
    """``.venv-<client>``'s interpreter, made (and ``ipuxl.compat --install``-ed) when missing."""
    venv = ROOT / f".venv-{client}"
    python, ready = venv / "bin" / "python", venv / "ipuxl-requirements.txt"
    wanted = repr(REQUIREMENTS[client])
    with venv_lock(venv):  # another xdist worker may be making it: wait for it, then use it
        if ready.exists() and ready.read_text() == wanted:
            return str(python)
        try:
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True,
                           capture_output=True, timeout=600)
            for args in REQUIREMENTS[client]:
                subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True, capture_output=True,
                               timeout=1800)
            subprocess.run([str(python), "-m", "ipuxl.compat", "--install"], check=True, capture_output=True,
                           timeout=600, env=environment())
        except (OSError, subprocess.SubprocessError):
            return str(python) if python.exists() else sys.executable
        ready.write_text(wanted)
    return str(python)


def run_client(python: str, script: Path, *args: str, timeout: int = 1200) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` in ``python``; raises with its output when it fails."""
    done = subprocess.run([python, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=environment())
    if done.returncode != 0:
        raise AssertionError(f"{script.name} {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-6000:]}")
    return done
