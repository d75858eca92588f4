"""``ipuxl.poptorch_compat.dataloader``: PopTorch-style ``DataLoader`` batch sizes, modes and errors."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from ipuxl.poptorch_compat.dataloader import DataLoader, DataLoaderMode
from ipuxl.errors import FrozenOptionsError, InvalidArgumentError, OptionsError
from ipuxl.poptorch_compat.options import Options
from tests.poptorch_compat._checks import raises_in

raises = raises_in(__file__)


def dataset(n: int = 24) -> TensorDataset:
    """Sample i is (x=[i, 10 i] float, y=i)."""
    index = torch.arange(n)
    return TensorDataset(torch.stack([index, 10 * index], dim=1).float(), index)


def labels(loader) -> list[list[int]]:
    return [y.tolist() for _, y in loader]


def options(device_iterations: int = 1, replicas: int = 1, accumulation: int = 1) -> Options:
    opts = Options().deviceIterations(device_iterations).replicationFactor(replicas)
    opts.Training.gradientAccumulation(accumulation)
    return opts


class Failing(Dataset):
    """Raises on sample ``bad``."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise KeyError(f"sample {i} is corrupt")
        return torch.tensor([float(i)])


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n).float().unsqueeze(1))


# -- combined batch size --------------------------------------------------------------
@pytest.mark.parametrize("di, replicas, accumulation, batch_size", [
    (1, 1, 1, 1), (3, 1, 1, 2), (1, 2, 1, 2), (1, 1, 4, 1), (2, 2, 3, 1),
])
def test_batches_hold_the_combined_batch(di, replicas, accumulation, batch_size):
    combined = batch_size * di * replicas * accumulation
    loader = DataLoader(options(di, replicas, accumulation), dataset(48), batch_size=batch_size)
    assert loader.combinedBatchSize == combined
    assert len(loader) == 48 // combined
    batches = list(loader)
    assert len(batches) == 48 // combined
    for k, (x, y) in enumerate(batches):
        assert x.shape == (combined, 2) and y.shape == (combined,)
        assert y.tolist() == list(range(k * combined, (k + 1) * combined))
        assert torch.equal(x[:, 1], 10 * y.float())


def test_is_a_torch_dataloader_with_upstream_attributes():
    opts = options(2)
    loader = DataLoader(opts, dataset(), batch_size=3)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert loader.options is opts
    assert loader.batch_size == 6  # torch's loader sees the combined batch
    assert loader.mode is DataLoaderMode.Sync
    assert loader.drop_last is True and loader.persistent_workers is False


def test_building_a_dataloader_freezes_its_options():
    opts = options()
    DataLoader(opts, dataset())
    assert opts.frozen
    with pytest.raises(FrozenOptionsError):
        opts.deviceIterations(2)


def test_drop_last_true_drops_the_partial_batch():
    loader = DataLoader(options(2), dataset(22), batch_size=2)
    assert len(loader) == 5
    assert labels(loader)[-1] == [16, 17, 18, 19]


def test_drop_last_false_keeps_a_smaller_last_batch_and_warns():
    with pytest.warns(UserWarning, match=r"22 samples are not a multiple of the combined batch size \(4\)"):
        loader = DataLoader(options(2), dataset(22), batch_size=2, drop_last=False)
    assert len(loader) == 6
    assert labels(loader)[-1] == [20, 21]


def test_batch_size_none_disables_batching():
    loader = DataLoader(options(4), dataset(5), batch_size=None)
    assert loader.combinedBatchSize is None
    x, y = next(iter(loader))
    assert x.shape == (2,) and y.item() == 0


def test_shuffle_is_reproducible_with_a_generator():
    def order(seed: int) -> list[list[int]]:
        return labels(DataLoader(options(2), dataset(), batch_size=3, shuffle=True,
                                 generator=torch.Generator().manual_seed(seed)))

    first = order(0)
    assert first == order(0)
    assert first != order(1)
    assert first != labels(DataLoader(options(2), dataset(), batch_size=3))
    assert sorted(sum(first, [])) == list(range(24)), "each sample exactly once"


def test_shuffle_is_reproducible_under_options_random_seed():
    def order() -> list[list[int]]:
        opts = options(2).randomSeed(5)  # like upstream, also seeds torch's RNG
        return labels(DataLoader(opts, dataset(), batch_size=3, shuffle=True))

    assert order() == order()


def test_iterable_dataset():
    loader = DataLoader(options(2), Stream(10), batch_size=2)
    assert [x.squeeze(1).tolist() for x in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# -- Async ------------------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [True, False])
def test_async_yields_exactly_the_sync_batches(drop_last):
    def batches(mode: DataLoaderMode) -> list:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # drop_last=False warns about the partial batch
            loader = DataLoader(options(2, 1, 2), dataset(30), batch_size=2, shuffle=True, drop_last=drop_last,
                                mode=mode, generator=torch.Generator().manual_seed(3))
        return [list(loader) for _ in range(2)], len(loader)  # two epochs

    (sync, sync_len), (async_, async_len) = batches(DataLoaderMode.Sync), batches(DataLoaderMode.Async)
    assert sync_len == async_len == (30 // 8 + (0 if drop_last else 1))
    assert len(async_[0]) == len(sync[0]) == sync_len
    for epoch_sync, epoch_async in zip(sync, async_):
        for (xs, ys), (xa, ya) in zip(epoch_sync, epoch_async, strict=True):
            assert torch.equal(xs, xa) and torch.equal(ys, ya)
    assert [y.tolist() for _, y in sync[0]] != [y.tolist() for _, y in sync[1]], "reshuffled per epoch"


def test_async_reads_ahead_in_a_background_thread():
    seen: list[str] = []

    class Recording(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            seen.append(threading.current_thread().name)
            return torch.tensor([i])

    loader = DataLoader(options(), Recording(), batch_size=2, mode=DataLoaderMode.Async)
    assert [b.squeeze(1).tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert set(seen) == {"ipuxl-dataloader-prefetch"}


def test_async_buffer_is_bounded():
    reads: list[int] = []
    started = threading.Event()

    class Counting(Dataset):
        def __len__(self) -> int:
            return 100

        def __getitem__(self, i: int) -> torch.Tensor:
            reads.append(i)
            started.set()
            return torch.tensor([i])

    loader = DataLoader(options(), Counting(), batch_size=1, mode=DataLoaderMode.Async,
                        async_options={"buffer_size": 2})
    iterator = iter(loader)
    assert next(iterator).item() == 0
    started.wait()
    iterator._thread.join(timeout=0.2)  # the producer blocks on the full queue; give it time to fill it
    # At most: 1 consumed + 2 queued + 1 waiting to be put.
    assert len(reads) <= 4
    loader.terminate()
    assert not iterator._thread.is_alive()
    with pytest.raises(StopIteration):
        next(iterator)


def test_async_abandoned_epoch_is_shut_down_by_the_next_one():
    loader = DataLoader(options(), dataset(12), batch_size=2, mode=DataLoaderMode.Async)
    first = iter(loader)
    assert next(first)[1].tolist() == [0, 1]
    thread = first._thread
    second = iter(loader)
    assert not thread.is_alive()
    assert [y.tolist() for _, y in second] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_async_propagates_the_dataset_exception():
    loader = DataLoader(options(), Failing(10, bad=5), batch_size=2, mode=DataLoaderMode.Async)
    iterator = iter(loader)
    assert [next(iterator).squeeze(1).tolist() for _ in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(KeyError, match="sample 5 is corrupt") as info:
        next(iterator)
    assert any("Async background thread" in note for note in getattr(info.value, "__notes__", []))
    assert not iterator._thread.is_alive()
    with pytest.raises(StopIteration):
        next(iterator)


def test_async_with_worker_processes_over_two_epochs():
    loader = DataLoader(options(2), dataset(16), batch_size=2, num_workers=1, mode=DataLoaderMode.Async)
    assert loader.persistent_workers is True  # None -> num_workers > 0, as upstream
    expected = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert labels(loader) == expected
    assert labels(loader) == expected
    loader.terminate()


# -- AsyncRebatched ---------------------------------------------------------------------------
def test_async_rebatched_reassembles_worker_batches():
    loader = DataLoader(options(3), dataset(20), batch_size=2, mode=DataLoaderMode.AsyncRebatched,
                        rebatched_worker_size=4)
    assert loader.combinedBatchSize == 6 and loader.batch_size == 4
    assert len(loader) == 3
    batches = list(loader)
    assert [y.tolist() for _, y in batches] == [list(range(0, 6)), list(range(6, 12)), list(range(12, 18))]
    assert all(x.shape == (6, 2) and torch.equal(x[:, 0], y.float()) for x, y in batches)


def test_async_rebatched_keeps_leftovers_without_drop_last():
    with pytest.warns(UserWarning, match="last batch holds 2 samples"):
        loader = DataLoader(options(3), dataset(20), batch_size=2, mode=DataLoaderMode.AsyncRebatched,
                            rebatched_worker_size=5, drop_last=False)
    assert len(loader) == 4
    assert labels(loader)[-1] == [18, 19]


def test_async_rebatched_validation():
    with raises(OptionsError, "rebatched_worker_size (7) must be between 1 and the combined batch size (6)"):
        DataLoader(options(3), dataset(), batch_size=2, mode=DataLoaderMode.AsyncRebatched,
                   rebatched_worker_size=7)
    with raises(OptionsError, "AsyncRebatched needs a batch size"):
        DataLoader(options(), dataset(), batch_size=None, mode=DataLoaderMode.AsyncRebatched)
    with pytest.warns(UserWarning, match="rebatched_worker_size=2 is ignored with DataLoaderMode.Sync"):
        DataLoader(options(), dataset(), rebatched_worker_size=2)


# -- argument errors --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, fragment", [
    (dict(batch_size=0), OptionsError, "batch_size must be >= 1, got 0"),
    (dict(batch_size=-3), OptionsError, "batch_size must be >= 1, got -3"),
    (dict(batch_size=2.0), InvalidArgumentError, "batch_size must be an int or None, got 2.0 (float)"),
    (dict(batch_size=True), InvalidArgumentError, "batch_size must be an int or None, got True"),
    (dict(num_workers=-1), OptionsError, "num_workers must be >= 0, got -1"),
    (dict(num_workers="2"), InvalidArgumentError, "num_workers must be an int"),
    (dict(mode="async"), InvalidArgumentError, "mode must be a DataLoaderMode, got 'async'"),
    (dict(drop_last=None), InvalidArgumentError, "drop_last must be True or False"),
    (dict(auto_distributed_partitioning=1), InvalidArgumentError, "auto_distributed_partitioning must be True"),
    (dict(mode=DataLoaderMode.Async, async_options=[3]), InvalidArgumentError, "async_options must be a dict"),
    (dict(mode=DataLoaderMode.Async, async_options={"buffer_size": 0}), OptionsError,
     "async_options['buffer_size'] must be an int >= 1, got 0"),
    (dict(mode=DataLoaderMode.Async, async_options={"bufer_size": 2}), OptionsError,
     "unknown async_options ['bufer_size']"),
    (dict(mode=DataLoaderMode.Async, async_options={"rebatched_size": 2}), OptionsError,
     "rebatched_size cannot be given in async_options"),
])
def test_argument_errors(kwargs, error, fragment):
    with raises(error, fragment) as info:
        DataLoader(options(), dataset(), **kwargs)
    builtin = TypeError if error is InvalidArgumentError else ValueError
    assert isinstance(info.value, builtin)


def test_options_must_be_ipuxl_options():
    with raises(InvalidArgumentError, "options must be an ipuxl.Options, got TensorDataset"):
        DataLoader(dataset(), dataset())


def test_upstream_async_options_are_accepted():
    loader = DataLoader(options(), dataset(4), batch_size=2, mode=DataLoaderMode.Async,
                        async_options={"buffer_size": 1, "load_indefinitely": True, "early_preload": False,
                                       "miss_sleep_time_in_ms": 0.1})
    assert labels(loader) == [[0, 1], [2, 3]]


def test_mode_values_match_upstream():
    assert [(m.name, int(m)) for m in DataLoaderMode] == [("Sync", 0), ("Async", 1), ("AsyncRebatched", 2)]


def test_a_refused_dataloader_leaves_its_options_unfrozen():
    opts = options()
    with pytest.raises(OptionsError):
        DataLoader(opts, dataset(), batch_size=0)
    with pytest.raises(ValueError):  # torch's own check: a sampler and shuffle=True
        DataLoader(opts, dataset(), shuffle=True, sampler=range(24))
    assert not opts.frozen
