"""``python -m ipuxl.compat --install``: Graphcore's import names in every process of an environment.

The step runs in a throwaway venv (``--system-site-packages``: torch comes from this
interpreter's packages), never in the environment the tests run in.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from ipuxl.compat import environment, startup_hook, table

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _python(venv: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(venv / "bin" / "python"), *args], capture_output=True, text=True, timeout=600,
                          env=env or ENV, cwd=venv)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("compat") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True,
                   timeout=600)
    return path


def _site_packages(venv: Path) -> Path:
    return Path(_python(venv, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())


def test_install_makes_the_names_importable_in_every_process_of_the_venv(venv):
    done = _python(venv, "-m", "ipuxl.compat", "--install")
    site = _site_packages(venv)
    assert str(site) in done.stdout and (site / "ipuxl_compat.pth").is_file() and (site / "_ipuxl_compat.py").is_file()
    # start-up stays cheap: nothing of ipuxl (or torch) is imported until a program asks for it
    assert _python(venv, "-c", "import sys; print('ipuxl' in sys.modules, 'torch' in sys.modules)").stdout.split() \
        == ["False", "False"]
    check = ("import importlib.util, ipuxl\n"
             "assert importlib.util.find_spec('poptorch') is not None\n"
             "import poptorch, popxl, popxl_addons, popdist, popart\n"
             "assert poptorch.__name__ == 'ipuxl.poptorch_compat' and popxl is ipuxl\n"
             "assert (popxl_addons.__name__, popdist.__name__, popart.__name__) == "
             "('ipuxl.addons_compat', 'ipuxl.popdist', 'ipuxl.popart_compat')\n"
             "assert poptorch.ipuHardwareIsAvailable()\n"
             "print('ok')\n")
    assert _python(venv, "-c", check).stdout.strip() == "ok"
    # a subprocess of a subprocess: the same interpreter's start-up installs the hook again
    nested = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {check!r}], check=True)"
    assert _python(venv, "-c", nested).stdout.strip() == "ok"
    # pytest (as Jupyter or a Lightning script) is just another process of the environment
    (venv / "test_uses_poptorch.py").write_text(textwrap.dedent("""
        import poptorch
        import torch

        def test_a_poptorch_model_runs():
            model = poptorch.inferenceModel(torch.nn.Linear(2, 2))
            assert model(torch.ones(3, 2)).shape == (3, 2)
        """))
    assert "1 passed" in _python(venv, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_uses_poptorch.py").stdout
    # IPUXL_COMPAT=0 turns the names off in one process
    off = _python(venv, "-c", "import importlib.util; print(importlib.util.find_spec('poptorch'))",
                  env={**ENV, "IPUXL_COMPAT": "0"})
    assert off.stdout.strip() == "None"


def test_uninstall_removes_it_and_the_test_environment_is_untouched(venv):
    _python(venv, "-m", "ipuxl.compat", "--install")
    assert "uninstalled" in _python(venv, "-m", "ipuxl.compat", "--uninstall").stdout
    site = _site_packages(venv)
    assert not (site / "ipuxl_compat.pth").exists() and not (site / "_ipuxl_compat.py").exists()
    assert _python(venv, "-c", "import importlib.util; print(importlib.util.find_spec('poptorch'))").stdout.strip() \
        == "None"
    assert "was not installed" in _python(venv, "-m", "ipuxl.compat", "--uninstall").stdout
    assert not (Path(sysconfig.get_paths()["purelib"]) / environment.PTH_NAME).exists()


def test_install_environment_writes_the_hook_beside_its_pth_file(tmp_path):
    written = environment.install_environment(tmp_path)
    assert sorted(p.name for p in written) == ["_ipuxl_compat.py", "ipuxl_compat.pth"]
    assert (tmp_path / "ipuxl_compat.pth").read_text() == "import _ipuxl_compat; _ipuxl_compat.activate()\n"
    assert (tmp_path / "_ipuxl_compat.py").read_text() == Path(startup_hook.__file__).read_text()
    assert environment.install_environment(tmp_path) == written  # idempotent
    assert environment.uninstall_environment(tmp_path) == [tmp_path / "ipuxl_compat.pth",
                                                          tmp_path / "_ipuxl_compat.py"]
    assert environment.uninstall_environment(tmp_path) == []


def test_the_lazy_finder_answers_only_for_graphcores_packages():
    finder = startup_hook.LazyCompatFinder()
    assert finder.find_spec("numpy") is None and finder.find_spec("poptorchx") is None
    assert set(startup_hook.ROOTS) == set(table.ROOTS)  # the hook imports nothing of ipuxl: its own copy
