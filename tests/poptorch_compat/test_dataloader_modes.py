"""PopTorch's ``DataLoader`` (``ipuxl.poptorch_compat.dataloader``) beyond its basics: the
same batches in the same order (so the same training) in every ``DataLoaderMode``, over
epochs with persistent workers as torch's loader, and the options it exposes."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

import ipuxl.poptorch_compat as poptorch
from tests.poptorch_compat.test_accessor import indexed, labels
from tests.poptorch_compat.test_custom_args import train


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
