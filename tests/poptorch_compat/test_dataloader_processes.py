"""``DataLoader`` split over host processes: ``replicationFactor`` counts one process's
replicas, as upstream, so any replication factor splits over any number of processes."""
from __future__ import annotations

import pytest
import torch

import ipuxl.poptorch_compat as poptorch


class _Increment(torch.utils.data.Dataset):
    def __init__(self, length: int):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return torch.tensor([float(index)])


@pytest.mark.parametrize("processes, batch, replicas", [(3, 4, 1), (2, 2, 1), (2, 1, 3)])
def test_each_process_reads_its_own_block_of_whole_combined_batches(processes, batch, replicas):
    dataset = _Increment(100)
    read = []
    for process in range(processes):
        opts = poptorch.Options().replicationFactor(replicas)
        opts.Distributed.configureProcessId(process, processes)
        loader = poptorch.DataLoader(opts, dataset, batch_size=batch)
        assert loader.combinedBatchSize == batch * replicas  # this process's replicas only
        assert opts.total_replicas() == replicas * processes
        assert len(loader) == 100 // (loader.combinedBatchSize * processes)
        read += [int(v) for b in loader for v in b.flatten()]
    per_process = loader.combinedBatchSize * (100 // (loader.combinedBatchSize * processes))
    assert read == list(range(processes * per_process))  # consecutive blocks, in process order


@pytest.mark.parametrize("processes", [2, 3])
def test_shuffled_processes_read_disjoint_samples_and_a_new_order_each_epoch(processes):
    dataset = _Increment(60)
    epochs = []
    for process in range(processes):
        opts = poptorch.Options().randomSeed(0)
        opts.Distributed.configureProcessId(process, processes)
        loader = poptorch.DataLoader(opts, dataset, batch_size=5, shuffle=True)
        epochs.append([sorted(int(v) for b in loader for v in b.flatten()) for _ in range(3)])
    for epoch in range(3):
        seen = [v for process in epochs for v in process[epoch]]
        assert len(seen) == len(set(seen))
    assert all(process[0] != process[1] for process in epochs)


def test_a_model_under_a_process_configuration_takes_the_process_batch():
    opts = poptorch.Options().replicationFactor(1)
    loader = poptorch.DataLoader(opts, _Increment(8), batch_size=2)
    model = poptorch.inferenceModel(torch.nn.Identity(), opts)
    out = torch.cat([model(b) for b in loader])
    torch.testing.assert_close(out, torch.arange(8.0).reshape(8, 1))
