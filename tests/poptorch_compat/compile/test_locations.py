"""PopTorch's ``Options.TensorLocations`` in the resource model (``poptorch_compat.compile.locations``):
off-chip weights / optimiser state are accounted in Streaming Memory with their per-step
traffic, replicated tensor sharding as each replica's shard; values are unchanged."""
from __future__ import annotations

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.device.resources import IpuSpec, use_spec
from ipuxl.errors import OutOfMemoryError


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y=None):
        out = self.b(torch.relu(self.a(x)))
        return out if y is None else (out, self.loss(out, y))


PARAM_BYTES = 4 * (64 * 64 + 64 + 64 * 4 + 4)


def _batch(n: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 64, generator=g), torch.randint(0, 4, (n,), generator=g)


def _offchip() -> poptorch.TensorLocationSettings:
    return poptorch.TensorLocationSettings().useOnChipStorage(False)


def _train(opts: poptorch.Options, steps: int = 2):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, opts, optimizer=optimizer)
    x, y = _batch(8 * opts.device_iterations)
    for _ in range(steps):
        training(x, y)
    training.copyWeightsToHost()
    return training, model


def _opts(iterations: int = 1) -> poptorch.Options:
    opts = poptorch.Options()
    opts.deviceIterations(iterations)
    return opts


def test_offchip_optimizer_state_is_accounted_in_streaming_memory_with_its_traffic():
    base, base_model = _train(_opts(3))
    opts = _opts(3)
    opts.TensorLocations.setOptimizerLocation(_offchip())
    moved, moved_model = _train(opts)
    before, after = base.report(), moved.report()
    # the momentum of each parameter (its shape, float32) leaves the chip for Streaming Memory
    assert after.memory.offchip_variable_bytes == PARAM_BYTES and after.memory.num_offchip_variables == 4
    assert before.memory.variable_bytes - after.memory.variable_bytes == PARAM_BYTES
    assert after.memory.streaming_memory_bytes - before.memory.streaming_memory_bytes == PARAM_BYTES
    assert before.memory.total_bytes - after.memory.total_bytes == PARAM_BYTES
    # loaded and stored once per step (training updates it); 3 steps per run
    assert (before.remote_per_run.loaded_bytes, before.remote_per_run.stored_bytes) == (0, 0)
    assert (after.remote_per_run.loaded_bytes, after.remote_per_run.stored_bytes) == (3 * PARAM_BYTES, 3 * PARAM_BYTES)
    assert after.remote_per_step.loaded_bytes == PARAM_BYTES
    assert "stored off-chip (tensor locations)" in str(after) and "Streaming Memory per step" in str(after)
    for p, q in zip(base_model.parameters(), moved_model.parameters()):  # values unchanged
        torch.testing.assert_close(p, q)


def test_offchip_weights_in_inference_are_loaded_each_step_never_stored():
    opts = _opts(2)
    opts.TensorLocations.setWeightLocation(_offchip())
    model = Net()
    inference = poptorch.inferenceModel(model, opts)
    x, _ = _batch(16)
    torch.testing.assert_close(inference(x), model(x))
    report = inference.report()
    assert report.memory.offchip_variable_bytes == PARAM_BYTES and report.memory.variable_bytes == 0
    assert (report.remote_per_run.loaded_bytes, report.remote_per_run.stored_bytes) == (2 * PARAM_BYTES, 0)


def test_min_elements_for_off_chip_keeps_small_tensors_on_chip():
    opts = _opts()
    opts.TensorLocations.setWeightLocation(_offchip().minElementsForOffChip(100))
    training, _ = _train(opts, steps=1)
    report = training.report()
    assert report.memory.num_offchip_variables == 2  # the two weight matrices, not the biases
    assert report.memory.offchip_variable_bytes == 4 * (64 * 64 + 64 * 4)


def test_replicated_tensor_sharding_holds_one_shard_per_replica():
    def report(sharded: bool):
        opts = _opts()
        opts.replicationFactor(2)
        if sharded:
            opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useReplicatedTensorSharding(
                True).minElementsForReplicatedTensorSharding(64))
        return _train(opts, steps=1)[0].report()

    whole, sharded = report(False), report(True)
    # momentum of a.weight (4096), a.bias (64), b.weight (256) is halved; b.bias (4 elements) is not sharded
    assert whole.memory.variable_bytes - sharded.memory.variable_bytes == 4 * (64 * 64 + 64 + 64 * 4) // 2
    assert sharded.memory.offchip_variable_bytes == 0


def test_offchip_state_makes_a_model_fit_the_ipu_model():
    base, _ = _train(_opts(), steps=1)
    total = base.report().memory.total_bytes
    spec = IpuSpec(memory_bytes_override=total - PARAM_BYTES // 2)
    with use_spec(spec):
        with pytest.raises(OutOfMemoryError, match="does not fit in the memory of one IPU"):
            opts = _opts()
            opts.useIpuModel(True)
            _train(opts, steps=1)
        opts = _opts()
        opts.useIpuModel(True)
        opts.TensorLocations.setOptimizerLocation(_offchip())
        _train(opts, steps=1)  # fits: the momentum is off-chip
