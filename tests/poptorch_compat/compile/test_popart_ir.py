"""``_debugGetPopartIR``: the ops ipuxl runs, by PopART's op types, as upstream's JSON dump."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import ExecutorError
from ipuxl.poptorch_compat import poptorch_core


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, t):
        out = self.lin(x)
        return out, self.loss(out, t)


_DATA = (torch.randn(3, 6), torch.tensor([0, 1, 3]))


def _types(model) -> Counter:
    ir = json.loads(model._debugGetPopartIR())
    assert list(ir) == ["maingraph"]
    return Counter(op["type"] for op in ir["maingraph"])


@pytest.mark.parametrize("make, updates", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), {"SGD0VarUpdate": 2}),
    (lambda ps: poptorch.optim.SGD(ps, lr=0.1, momentum=0.9), {"SGD2VarUpdate": 2}),
    (lambda ps: torch.optim.AdamW(ps, lr=0.1), {"AdamUpdater": 2, "AdamVarUpdate": 2}),
    (lambda ps: poptorch.optim.LAMB(ps, lr=0.1), {"AdamUpdater": 2, "AdamVarUpdate": 2}),
])
def test_one_optimiser_update_per_trained_weight(make, updates):
    net = _Classifier()
    model = poptorch.trainingModel(net, optimizer=make(net.parameters()))
    model(*_DATA)
    types = _types(model)
    for kind, count in updates.items():
        assert types[kind] == count, types
    assert types["MatMul"] >= 2 and types["LogSoftmax"] == 1 and types["Nll"] == 1 and types["NllGrad"] == 1
    assert not any(kind.startswith(("Adam", "SGD")) for kind in types if kind not in updates)


def test_an_inference_dump_lists_the_forward_in_order_with_tensors():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8, 2))
    model = poptorch.inferenceModel(net)
    model(torch.randn(1, 1, 4, 4))
    ops = json.loads(poptorch_core._getPopartIR(model))["maingraph"]
    kinds = [op["type"] for op in ops]
    assert kinds.index("Conv") < kinds.index("Relu") < kinds.index("MatMul")
    conv = ops[kinds.index("Conv")]
    assert conv["name"] == f"Conv:{kinds.index('Conv')}" and conv["outputs"][0]["shape"] == [1, 2, 2, 2]
    assert conv["inputs"][1]["name"] == "0.weight" and conv["inputs"][1]["type"] == "float32"


def test_training_tensors_have_upstreams_names():
    net = _Classifier()
    model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    model(*_DATA)
    names = {t["name"] for op in json.loads(model._debugGetPopartIR())["maingraph"] for t in op["inputs"]}
    assert {"model.lin.weight", "model.lin.bias"} <= names
    tensors = model.getTensorNames()
    assert "scaledLearningRate0___specific___model.lin.weight" in tensors and "lossScaling_FLOAT" in tensors


def test_the_dump_needs_a_compiled_model():
    model = poptorch.inferenceModel(torch.nn.Linear(2, 2))
    with pytest.raises(ExecutorError):
        model._debugGetPopartIR()
