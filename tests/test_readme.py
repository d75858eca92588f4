"""The README's first lines are the two commands, and its Python example runs."""
from __future__ import annotations

import importlib.metadata
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.conftest import ROOT


def test_readme_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0] == "```bash"
    assert lines[1].startswith("pip install -e . && ") and "python examples/popxl_mnist.py" in lines[1]
    assert lines[2].startswith('pip install -e ".[test]" && ') and "python -m pytest tests" in lines[2]
    assert "torch" not in lines[1] + lines[2]  # one install, the one setup.py declares: no torch pip undoes
    ci = (ROOT / ".ci" / "run").read_text()
    assert lines[2] in ci.splitlines()  # CI runs exactly the README's test command


def _install_requires(monkeypatch: pytest.MonkeyPatch, *, hide_torch: bool) -> list[str]:
    """setup.py's ``install_requires``; ``hide_torch``: computed as in pip's isolated
    build, where no torch is installed (importing torch or asking for an installed
    version fails)."""
    import setuptools

    captured: dict = {}

    def no_installed_versions(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    with monkeypatch.context() as patch:
        patch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
        if hide_torch:
            patch.setattr(importlib.metadata, "version", no_installed_versions)
            patch.setitem(sys.modules, "torch", None)  # ``import torch`` raises ImportError
            patch.setitem(sys.modules, "torchvision", None)
        exec(compile((ROOT / "setup.py").read_text(), "setup.py", "exec"), {"__name__": "__main__"})
    return captured["install_requires"]


def test_setup_pins_the_tested_torch_statically(monkeypatch: pytest.MonkeyPatch):
    isolated = _install_requires(monkeypatch, hide_torch=True)
    assert isolated == _install_requires(monkeypatch, hide_torch=False)  # nothing read from the environment
    tested_torch = torch.__version__.split("+")[0]  # the suite runs on the tested pair
    tested_vision = importlib.metadata.version("torchvision").split("+")[0]
    assert f"torch=={tested_torch}" in isolated and f"torchvision=={tested_vision}" in isolated
    readme = (ROOT / "README.md").read_text()
    assert f"torch {tested_torch} and torchvision {tested_vision}" in readme  # the tested versions, named


def test_readme_example_runs_and_matches_eager():
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    session, w = scope["session"], scope["w"]
    x = torch.ones(8, 4)
    w0 = torch.from_numpy(scope["w0"]).requires_grad_(True)
    y = F.gelu(x @ w0, approximate="tanh")
    (grad,) = torch.autograd.grad(y.sum(), w0)
    assert_close(torch.from_numpy(scope["y"]), y.detach())
    assert_close(torch.from_numpy(session.get_tensor_data(w)), w0.detach() - 0.1 * grad)


def _block(marker: str) -> str:
    """The README's Python block that contains ``marker``."""
    return [c for c in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S) if marker in c][0]


def test_readme_device_loop_example_matches_an_eager_loop():
    scope: dict = {}
    exec(compile(_block("the device loop: 50 iterations"), "README.md", "exec"), scope)
    w = torch.zeros(4, 1)
    losses = []
    for x in torch.from_numpy(scope["xs"]):
        err = x @ w - 1.0
        losses.append((err * err).mean())
        w = w - 0.01 * (x.T @ err)
    assert_close(torch.from_numpy(scope["losses"]), torch.stack(losses))
    assert_close(torch.from_numpy(scope["session"].get_tensor_data(scope["w"])), w)


def test_readme_poptorch_example_runs_and_matches_eager_eval():
    code = _block("ipuxl.trainingModel(")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    model, dataset = scope["model"], scope["dataset"]
    assert scope["preds"].shape == (400, 10) and scope["losses"].shape == (50,)
    assert scope["training"].compile_count == 1
    model.eval()
    with torch.no_grad():  # reading the host model pulls the trained weights
        assert_close(scope["logits"], model(dataset.tensors[0][:80]))


def test_readme_replication_example_runs_and_averages_over_replicas():
    code = [c for c in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
            if "Ir(replication=2)" in c][0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    data = torch.from_numpy(scope["data"])                 # (steps, replicas, 4)
    mean = (data * 2.0).mean(1, keepdim=True)               # every replica gets the replicas' mean
    assert_close(torch.from_numpy(scope["g_out"]), mean.expand_as(data))
    assert_close(torch.from_numpy(scope["w_final"]), -0.1 * mean[:, 0].sum(0))
