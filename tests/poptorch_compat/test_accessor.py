"""PopTorch's ``AsynchronousDataAccessor`` (``ipuxl.poptorch_compat.accessor``): a loader's
batches in order every epoch, read ahead in the background, rebatched, and its errors."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.testing import assert_close
from torch.utils.data import Dataset, TensorDataset

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import InvalidArgumentError, OptionsError, PoptorchError
from ipuxl.poptorch_compat.enums import SharingStrategy
from tests.poptorch_compat._checks import raises_in
from tests.poptorch_compat.test_custom_args import Batch, collate, regression_data

raises = raises_in(__file__)


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
