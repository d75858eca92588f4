"""Per-IPU memory of PopTorch programs (``device.ipus``): the stages of a PopTorch program
run inside the main graph's ``repeat`` body, and each of their ops is charged to its own
IPU, so a model that does not fit one IPU fits split in two blocks."""
from __future__ import annotations

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.device.resources import IpuSpec, estimate, use_spec
from ipuxl.errors import OutOfMemoryError

MiB = 1024 * 1024


class TwoBig(torch.nn.Module):
    """Two 256x256 layers (256 KiB of weights each), in blocks "A" and "B" when ``split``."""

    def __init__(self, split: bool):
        super().__init__()
        self.a, self.b = torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)
        self.c = torch.nn.Linear(8, 8)
        self.a2 = torch.nn.Linear(256, 256)
        self.split = split
        self.loss = torch.nn.CrossEntropyLoss()

    def _block(self, name: str, ipu: int):
        return poptorch.Block(name, ipu_id=ipu) if self.split else _nothing()

    def forward(self, x, y):
        with self._block("A", 0):
            h = torch.relu(self.a(x))
        with self._block("B", 1):
            h = torch.relu(self.a2(h))
            out = self.c(self.b(h))
            loss = self.loss(out, y)
        return out, loss


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _training(split: bool, ipu_model: bool) -> poptorch.PoplarExecutor:
    torch.manual_seed(0)
    model = TwoBig(split)
    opts = poptorch.Options()
    if split:
        opts.setExecutionStrategy(poptorch.PipelinedExecution("A", "B"))
    opts.Training.gradientAccumulation(4)
    opts.useIpuModel(ipu_model)
    return poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 256, generator=g), torch.randint(0, 8, (16,), generator=g)


SPEC = IpuSpec(code_bytes_per_op=1024)


def _split_and_unsplit_reports():
    with use_spec(SPEC):
        split, unsplit = _training(True, False), _training(False, False)
        split(*_batch()), unsplit(*_batch())
        return split.report(), unsplit.report()


def test_the_per_ipu_numbers_add_up_to_the_unsplit_program():
    split, unsplit = _split_and_unsplit_reports()
    ipus = split.ipus
    assert ipus is not None and unsplit.ipus is None and len(ipus.ipus) == 2
    one = unsplit.memory
    total = {name: sum(getattr(u, name) for u in ipus.ipus)
             for name in ("variable_bytes", "num_variables", "flops", "code_bytes", "code_ops")}
    assert total["variable_bytes"] == one.variable_bytes and total["num_variables"] == one.num_variables
    assert total["flops"] == unsplit.flops_per_run
    assert (total["code_bytes"], total["code_ops"]) == (split.memory.code_bytes, split.memory.code_ops)
    # every IPU runs a share of code, FLOPs, activations and streams: none of it stays on IPU 0 only
    for usage in ipus.ipus:
        assert usage.code_ops > 0 and usage.flops > 0 and usage.activation_bytes > 0 and usage.stream_bytes > 0
    # the weights of "a" (IPU 0) and "a2", "b", "c" (IPU 1), with the lr variable on IPU 0
    weights = {0: 256 * 256 + 256, 1: 256 * 256 + 256 + 256 * 8 + 8 + 8 * 8 + 8}
    assert abs(ipus.ipus[0].variable_bytes - 4 * weights[0]) <= 16
    assert abs(ipus.ipus[1].variable_bytes - 4 * weights[1]) <= 16


def test_a_model_too_large_for_one_ipu_fits_split_over_two():
    split, unsplit = _split_and_unsplit_reports()
    assert split.ipus is not None
    largest = max(u.total_bytes for u in split.ipus.ipus)
    assert largest < unsplit.memory.total_bytes
    memory = (largest + unsplit.memory.total_bytes) // 2
    spec = IpuSpec(code_bytes_per_op=1024, memory_bytes_override=memory)
    with use_spec(spec):
        training = _training(True, True)
        training(*_batch())  # each IPU's share fits
        unsplit_training = _training(False, True)
        with pytest.raises(OutOfMemoryError, match="does not fit in the memory of one IPU"):
            unsplit_training(*_batch())


def test_out_of_memory_names_the_ipu_of_a_poptorch_block_that_does_not_fit():
    split, _ = _split_and_unsplit_reports()
    assert split.ipus is not None
    smaller, larger = sorted(split.ipus.ipus, key=lambda u: u.total_bytes)
    assert smaller.total_bytes < larger.total_bytes
    memory = (smaller.total_bytes + larger.total_bytes) // 2
    with use_spec(IpuSpec(code_bytes_per_op=1024, memory_bytes_override=memory)):
        training = _training(True, True)
        with pytest.raises(OutOfMemoryError, match=f"IPU {larger.ipu} of 2 is out of memory") as caught:
            training(*_batch())
    assert "BeginBlock" in caught.value.fix
