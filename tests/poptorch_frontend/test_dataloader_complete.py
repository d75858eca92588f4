"""PopTorch's data API beyond the DataLoader basics: custom argument types
(``ICustomArgParser``, ``registerCustomArgParser``), ``AsynchronousDataAccessor``, and
the same batches in the same order (so the same training) in every ``DataLoaderMode``."""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close
from torch.utils.data import Dataset, TensorDataset

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import InvalidArgumentError, OptionsError, PoptorchError
from ipuxl.poptorch_compat.enums import SharingStrategy
from tests.poptorch_frontend._checks import raises_in

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


@pytest.mark.parametrize("mode, kwargs", [
    (poptorch.DataLoaderMode.Async, {}),
    (poptorch.DataLoaderMode.AsyncRebatched, {}),
    (poptorch.DataLoaderMode.AsyncRebatched, {"rebatched_worker_size": 3}),
])
def test_every_mode_gives_the_same_training(mode, kwargs):
    weight, losses = train(poptorch.DataLoaderMode.Sync)
    weight_async, losses_async = train(mode, **kwargs)
    assert_close(torch.stack(losses_async), torch.stack(losses), rtol=0, atol=0)
    assert_close(weight_async, weight, rtol=0, atol=0)


def test_register_custom_arg_parser_errors():
    with raises(InvalidArgumentError, "must be an ICustomArgParser", "got the class BatchParser"):
        poptorch.registerCustomArgParser(Batch, BatchParser)  # the class, not an instance
    with raises(InvalidArgumentError, "arg_type must be a class"):
        poptorch.registerCustomArgParser(Batch(torch.ones(1), torch.ones(1)), BatchParser())
    with raises(InvalidArgumentError, "tuple is handled by PopTorch itself"):
        poptorch.registerCustomArgParser(tuple, BatchParser())
    with pytest.raises(TypeError):  # the interface is abstract, as upstream
        poptorch.ICustomArgParser()


# -- AsynchronousDataAccessor -----------------------------------------------------------------
def labels(batches) -> list[list[int]]:
    return [y.flatten().tolist() for _, y in batches]


def indexed(n: int) -> TensorDataset:
    index = torch.arange(n)
    return TensorDataset(index.float().unsqueeze(1), index)


def test_accessor_gives_the_loaders_batches_in_order_every_epoch():
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), indexed(20), batch_size=2,
                                 shuffle=True, generator=torch.Generator().manual_seed(0))
    reference = poptorch.DataLoader(poptorch.Options().deviceIterations(2), indexed(20), batch_size=2,
                                    shuffle=True, generator=torch.Generator().manual_seed(0))
    accessor = poptorch.AsynchronousDataAccessor(loader, buffer_size=2)
    assert len(accessor) == len(loader) == 5
    for _ in range(2):
        assert labels(accessor) == labels(reference)
    accessor.terminate()


def test_accessor_rebatches_samples():
    loader = poptorch.DataLoader(poptorch.Options(), indexed(10), batch_size=1)
    accessor = poptorch.AsynchronousDataAccessor(loader, rebatched_size=4)
    assert len(accessor) == 2
    assert labels(accessor) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the leftover 2 are dropped, as upstream
    loader.rebatched_drop_last = False
    assert labels(accessor) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_accessor_rebatches_custom_batches():
    loader = poptorch.DataLoader(poptorch.Options(), regression_data(6), batch_size=2, collate_fn=collate)
    batches = list(poptorch.AsynchronousDataAccessor(loader, rebatched_size=3))
    assert [type(b) for b in batches] == [Batch, Batch]
    assert_close(torch.cat([b.x for b in batches]), regression_data(6).tensors[0])


class Recording(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.read = n, threading.Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= self.n:
            raise IndexError(i)  # ends Python's iteration over a sequence
        self.read.set()
        return torch.tensor([float(i)])


@pytest.mark.parametrize("early_preload", [False, True])
def test_accessor_early_preload_reads_before_iteration(early_preload):
    data = Recording(4)
    accessor = poptorch.AsynchronousDataAccessor(data, early_preload=early_preload)
    assert data.read.wait(timeout=2.0 if early_preload else 0.2) == early_preload
    assert [b.item() for b in accessor] == [0.0, 1.0, 2.0, 3.0]
    accessor.terminate()


def test_accessor_after_terminate_and_on_an_async_loader():
    accessor = poptorch.AsynchronousDataAccessor(indexed(4))
    accessor.terminate()
    with raises(PoptorchError, "after terminate()"):
        iter(accessor)
    loader = poptorch.DataLoader(poptorch.Options(), indexed(4), mode=poptorch.DataLoaderMode.Async)
    with raises(PoptorchError, "The DataLoader already uses an AsynchronousDataAccessor internally",
                "DataLoaderMode.Async"):
        poptorch.AsynchronousDataAccessor(loader)


@pytest.mark.parametrize("kwargs, error, fragment", [
    (dict(buffer_size=0), OptionsError, "buffer_size must be an int >= 1"),
    (dict(rebatched_size=1), OptionsError, "rebatched_size must be None or an int greater than 1"),
    (dict(sharing_strategy="fork"), InvalidArgumentError, "sharing_strategy must be a poptorch.SharingStrategy"),
    (dict(miss_sleep_time_in_ms=-1), OptionsError, "miss_sleep_time_in_ms must be a number >= 0"),
    (dict(load_indefinitely=None), InvalidArgumentError, "load_indefinitely must be True or False"),
])
def test_accessor_argument_errors(kwargs, error, fragment):
    with raises(error, fragment):
        poptorch.AsynchronousDataAccessor(indexed(4), **kwargs)


def test_accessor_accepts_upstreams_worker_options():
    accessor = poptorch.AsynchronousDataAccessor(indexed(3), miss_sleep_time_in_ms=1.0, load_indefinitely=False,
                                                 sharing_strategy=SharingStrategy.Fork)
    assert labels(accessor) == [[0], [1], [2]]
    assert accessor.sharing_strategy is SharingStrategy.Fork


def test_accessor_re_raises_the_datasets_error():
    class Broken(Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> torch.Tensor:
            if i == 1:  # raised in the middle of the first pass
                raise KeyError("sample 1 is corrupt")
            return torch.zeros(1)

    with pytest.raises(KeyError, match="sample 1 is corrupt"):
        list(poptorch.AsynchronousDataAccessor(Broken()))


@pytest.mark.parametrize("mode", [poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async])
def test_persistent_workers_read_as_torchs_loader_over_epochs(mode):
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), indexed(16), batch_size=2, shuffle=True,
                                 num_workers=2, generator=torch.Generator().manual_seed(2), mode=mode)
    assert loader.persistent_workers  # None means num_workers > 0, as upstream
    reference = torch.utils.data.DataLoader(indexed(16), batch_size=4, shuffle=True, num_workers=2,
                                            persistent_workers=True, drop_last=True,
                                            generator=torch.Generator().manual_seed(2))
    assert [labels(loader) for _ in range(2)] == [labels(reference) for _ in range(2)]


def test_dataloader_exposes_options_and_combined_batch_size():
    options = poptorch.Options().deviceIterations(3)
    options.Training.gradientAccumulation(2)
    loader = poptorch.DataLoader(options, indexed(24), batch_size=2)
    assert loader.options is options and loader.combinedBatchSize == 12
    assert copy.copy(loader.options) is not None  # frozen options can still be copied
