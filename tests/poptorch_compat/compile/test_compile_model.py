"""``Options.Training.accumulationAndReplicationReductionType``: Mean (default) or Sum
of the micro-batches' and replicas' gradients, against eager PyTorch."""
from __future__ import annotations

import copy

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from tests.poptorch_compat.runtime.test_executor import MLP, assert_same_weights, make_data


def eager_sum_steps(model, optimizer, x, y, micro: int, per_step: int) -> None:
    """One optimiser step per ``per_step`` micro-batches, on the sum of their mean losses."""
    for xs, ys in zip(x.split(micro * per_step), y.split(micro * per_step)):
        optimizer.zero_grad()
        loss = sum(model(a, b)[1] for a, b in zip(xs.split(micro), ys.split(micro)))
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("accumulation, replicas", [(3, 1), (1, 2), (2, 2)])
def test_sum_reduction_steps_on_the_sum_of_micro_batch_and_replica_gradients(accumulation, replicas):
    torch.manual_seed(5)
    model = MLP()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(2).replicationFactor(replicas)
    opts.Training.gradientAccumulation(accumulation)
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    training = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    micro = 4
    x, y = make_data(2 * accumulation * replicas * micro)
    training(x, y)
    # the combined batch is [device iteration][replica][micro-batch] (PopTorch's order)
    eager_sum_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.05), x, y, micro, accumulation * replicas)
    assert_same_weights(model, ref, rtol=1e-4, atol=1e-6)


def test_mean_is_the_default_and_a_sum_step_is_accumulation_times_larger():
    """One plain-SGD step: the Sum update is G times the Mean (default) update."""
    torch.manual_seed(6)
    start = MLP()
    x, y = make_data(3 * 4)
    deltas = []
    for reduction in (None, poptorch.ReductionType.Sum):
        model = copy.deepcopy(start)
        opts = poptorch.Options()
        opts.Training.gradientAccumulation(3)
        if reduction is not None:
            opts.Training.accumulationAndReplicationReductionType(reduction)
        poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))(x, y)
        deltas.append([p.detach() - q.detach() for p, q in zip(model.parameters(), start.parameters())])
    assert poptorch.Options().Training.accumulation_and_replication_reduction_type == poptorch.ReductionType.Mean
    for mean, total in zip(*deltas):
        torch.testing.assert_close(total, 3 * mean, rtol=1e-4, atol=1e-7)


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.layer(x)
        return out, self.loss(out, y)


def test_outputs_go_to_the_host_before_the_backward_and_keep_the_forward_values():
    """A step stores its outputs right after the forward (a language model's logits need not
    live through the backward), still the forward's values: the update comes later."""
    torch.manual_seed(0)
    model = _Head()
    eager = copy.deepcopy(model)
    x, y = torch.randn(2 * 3, 4), torch.tensor([0, 2, 1, 1, 0, 2])
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(3),
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = training(x, y)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for xs, ys in zip(x.chunk(3), y.chunk(3)):
        opt.zero_grad()
        want, ref = eager(xs, ys)
        ref.backward()
        opt.step()
    torch.testing.assert_close(out, want.detach())  # OutputMode Final: the last iteration's logits
    torch.testing.assert_close(loss, ref.detach())
    session = training.session
    code = "\n".join(c.module.code for c in map(session.compiled_graph, session.ir.graphs) if c is not None)
    stores = [code.index(f"store_output{i} =") for i in range(2)]
    assert max(stores) < code.index("nll_loss_backward"), code
