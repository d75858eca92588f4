"""The README's first lines are the two commands, and its Python example runs."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch.testing import assert_close

from conftest import ROOT


def test_readme_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0] == "```bash"
    assert "python examples/popxl_mnist.py" in lines[1]
    assert "python -m pytest tests" in lines[2]
    ci = (ROOT / ".ci" / "run").read_text()
    assert lines[2].split("&& ")[-1] in ci


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
