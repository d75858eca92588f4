"""``DataLoader`` with a custom ``batch_sampler``: its index lists are micro-batches, and one run
of the model takes deviceIterations x replicas x gradientAccumulation of them (PopTorch's rule)."""
from __future__ import annotations

import pytest
import torch

import ipuxl.poptorch_compat as poptorch


class _EvenThenOdd(torch.utils.data.Sampler):
    """Batches of 4 indices: the even ones first, then the odd ones."""

    def __init__(self, length: int):
        self.length = length

    def __iter__(self):
        order = list(range(0, self.length, 2)) + list(range(1, self.length, 2))
        return iter([order[i:i + 4] for i in range(0, self.length, 4)])

    def __len__(self):
        return (self.length + 3) // 4


_DATA = torch.utils.data.TensorDataset(torch.arange(16.0).reshape(16, 1))


@pytest.mark.parametrize("mode", list(poptorch.DataLoaderMode)[:2])
def test_the_batch_sampler_decides_the_batches(mode):
    loader = poptorch.DataLoader(poptorch.Options(), _DATA, batch_sampler=_EvenThenOdd(16), mode=mode)
    batches = [b[0].flatten().long().tolist() for b in loader]
    assert batches == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert loader.combinedBatchSize is None and len(loader) == 4


def test_batches_from_a_batch_sampler_feed_a_model_with_device_iterations():
    opts = poptorch.Options().deviceIterations(2)
    loader = poptorch.DataLoader(opts, _DATA, batch_sampler=_EvenThenOdd(16))
    model = poptorch.inferenceModel(torch.nn.Identity(), opts)
    out = [model(b[0]).flatten().long().tolist() for b in loader]
    assert out == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]] and len(loader) == 2


class _Growing(torch.utils.data.Sampler):
    """Batches of 1, 2, 3, 1, 2, 3... indices in order (a dynamic batch size)."""

    def __init__(self, length: int):
        self.length = length

    def __iter__(self):
        start, size = 0, 1
        while start < self.length:
            yield list(range(start, min(start + size, self.length)))
            start, size = start + size, size % 3 + 1

    def __len__(self):
        return len(list(iter(self)))


def _pairs(samples):
    """collate_fn: a tuple (values, doubled values), each (n, 1)."""
    values = torch.stack([s[0] for s in samples])
    return values, values * 2


@pytest.mark.parametrize("mode", list(poptorch.DataLoaderMode)[:2])
@pytest.mark.parametrize("drop_last", [True, False])
def test_runs_of_batches_are_concatenated_and_a_short_last_run_follows_drop_last(mode, drop_last):
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)  # 4 batches per run
    data = torch.utils.data.TensorDataset(torch.arange(13.0).reshape(13, 1))
    loader = poptorch.DataLoader(opts, data, batch_sampler=_Growing(13), collate_fn=_pairs, drop_last=drop_last,
                                 mode=mode)
    got = list(loader)
    # the sampler's batches: [0] [1 2] [3 4 5] [6] | [7 8] [9 10 11] [12]
    expected = [list(range(0, 7))] + ([] if drop_last else [list(range(7, 13))])
    assert [values.flatten().long().tolist() for values, _ in got] == expected
    assert all(torch.equal(doubled, values * 2) for values, doubled in got)
    assert len(loader) == len(expected)


@pytest.mark.parametrize("extra", [{"batch_size": 2}, {"shuffle": True},
                                   {"sampler": torch.utils.data.SequentialSampler(range(16))}])
def test_a_batch_sampler_excludes_the_batching_arguments_as_torch(extra):
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive"):
        poptorch.DataLoader(poptorch.Options(), _DATA, batch_sampler=_EvenThenOdd(16), **extra)


def test_a_batch_sampler_cannot_be_rebatched():
    with pytest.raises(ValueError, match="AsyncRebatched needs a batch size"):
        poptorch.DataLoader(poptorch.Options(), _DATA, batch_sampler=_EvenThenOdd(16),
                            mode=poptorch.DataLoaderMode.AsyncRebatched)
