"""PopTorch's custom argument types (``ICustomArgParser``, ``registerCustomArgParser``,
``ipuxl.poptorch_compat.custom_args``): a model's inputs and outputs of a registered
type, and training on them, against eager PyTorch."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import InvalidArgumentError
from tests.poptorch_compat._checks import raises_in

raises = raises_in(__file__)

# -- custom argument types ------------------------------------------------------------------
@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    tag: str = "batch"


class LabelledBatch(Batch):
    """A subclass: found through the parser registered for ``Batch``."""


class BatchParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.x
        yield struct.y

    def reconstruct(self, original_structure, tensor_iterator):
        return type(original_structure)(next(tensor_iterator), next(tensor_iterator), original_structure.tag)


poptorch.registerCustomArgParser(Batch, BatchParser())


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, batch: Batch):
        out = self.fc(batch.x)
        return out, nn.functional.mse_loss(out, batch.y)


class Echo(nn.Module):
    def forward(self, batch: Batch):
        return Batch(batch.x * 2, batch.y.sum(), "out")


def test_custom_type_input_and_output_match_eager():
    model = poptorch.inferenceModel(Echo(), poptorch.Options().deviceIterations(2))
    for scale in (1.0, 3.0):  # a second call with new values runs the same program
        batch = LabelledBatch(torch.randn(4, 3) * scale, torch.randn(4, 1))
        out = model(batch)
        assert type(out) is Batch and out.tag == "out"
        assert_close(out.x, batch.x * 2)
        assert_close(out.y, torch.stack([batch.y[:2].sum(), batch.y[2:].sum()]))  # a scalar per iteration
    assert model.compile_count == 1


def collate(samples) -> Batch:
    xs, ys = zip(*samples)
    return Batch(torch.stack(xs), torch.stack(ys))


def regression_data(n: int = 32) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=generator), torch.randn(n, 1, generator=generator))


def train(mode: poptorch.DataLoaderMode, **loader_kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Two epochs of SGD on shuffled custom batches; the weights and the losses."""
    torch.manual_seed(1)
    model = Regression()
    options = poptorch.Options().deviceIterations(2)
    loader = poptorch.DataLoader(options, regression_data(), batch_size=4, shuffle=True, collate_fn=collate,
                                 generator=torch.Generator().manual_seed(5), mode=mode, **loader_kwargs)
    training = poptorch.trainingModel(model, options, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    losses = [training(batch)[1] for _ in range(2) for batch in loader]
    training.copyWeightsToHost()
    return model.fc.weight.detach().clone(), losses


def test_training_on_custom_batches_matches_eager():
    weight, losses = train(poptorch.DataLoaderMode.Sync)
    torch.manual_seed(1)
    eager = Regression()
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(regression_data(), batch_size=8, shuffle=True, collate_fn=collate,
                                         generator=torch.Generator().manual_seed(5), drop_last=True)
    expected = []
    for _ in range(2):
        for batch in loader:
            for half in (slice(0, 4), slice(4, 8)):
                optimizer.zero_grad()
                loss = eager(Batch(batch.x[half], batch.y[half]))[1]
                loss.backward()
                optimizer.step()
            expected.append(loss.detach())
    assert_close(torch.stack(losses), torch.stack(expected))
    assert_close(weight, eager.fc.weight.detach())


def test_register_custom_arg_parser_errors():
    with raises(InvalidArgumentError, "must be an ICustomArgParser", "got the class BatchParser"):
        poptorch.registerCustomArgParser(Batch, BatchParser)  # the class, not an instance
    with raises(InvalidArgumentError, "arg_type must be a class"):
        poptorch.registerCustomArgParser(Batch(torch.ones(1), torch.ones(1)), BatchParser())
    with raises(InvalidArgumentError, "tuple is handled by PopTorch itself"):
        poptorch.registerCustomArgParser(tuple, BatchParser())
    with pytest.raises(TypeError):  # the interface is abstract, as upstream
        poptorch.ICustomArgParser()
