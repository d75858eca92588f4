"""Options().replicationFactor(R) for trainingModel / inferenceModel, against eager PyTorch.

Layout (PopART's host data shape ``[batches_per_step, accl_factor, repl_factor,
micro_batch_size, *sample_shape]``): the combined batch is iterations outermost,
then gradient accumulation, then replicas, then the micro-batch. One training step
(one device iteration) of R replicas with G accumulated micro-batches each equals
one eager optimiser step on the step's G x R x micro samples with a mean-reduced
loss.
"""
from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import ipuxl
from ipuxl import Options, OutputMode
from ipuxl.errors import BatchSizeError, OptionsError

from tests.conftest import ROOT
from tests.poptorch_compat._checks import raises_in
from tests.poptorch_compat.runtime.test_executor import MLP, assert_same_weights, make_data

raises = raises_in(__file__)
TOL = dict(rtol=1e-5, atol=1e-6)


def eager_reference(model: nn.Module, optimizer: torch.optim.Optimizer, x, y, steps: int, micro: int):
    """One eager optimiser step per device iteration on its whole combined batch.

    Returns the step-batch outputs ``(steps, batch / steps, C)`` and each micro-batch's
    loss under the step's weights ``(steps, micro-batches per step)``.
    """
    outs, losses = [], []
    for xs, ys in zip(x.chunk(steps), y.chunk(steps)):
        optimizer.zero_grad()
        out, loss = model(xs, ys)
        loss.backward()
        optimizer.step()
        outs.append(out.detach())
        with torch.no_grad():
            losses.append(torch.stack([model.loss(o, t) for o, t in zip(out.split(micro), ys.split(micro))]))
    return torch.stack(outs), torch.stack(losses)


OPTIMISERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
}


def _options(n: int, g: int, r: int, mode: OutputMode | None = None, period: int | None = None) -> Options:
    opts = Options().deviceIterations(n).replicationFactor(r)
    opts.Training.gradientAccumulation(g)
    if mode is not None:
        opts.outputMode(mode, period)
    return opts


@pytest.mark.parametrize("name", sorted(OPTIMISERS))
@pytest.mark.parametrize("n,g,r", [(3, 1, 2), (2, 1, 4), (3, 2, 2)])
def test_training_equals_eager_steps_on_the_combined_batch(name, n, g, r):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    micro = 3
    training = ipuxl.trainingModel(model, _options(n, g, r, OutputMode.All), optimizer=OPTIMISERS[name](model))
    ref_opt = OPTIMISERS[name](ref)
    for call in range(2):  # two runs: state (weights, optimiser) persists on the device
        x, y = make_data(n * g * r * micro, seed=call)
        out, losses = training(x, y)
        ref_out, ref_losses = eager_reference(ref, ref_opt, x, y, n, micro)
        assert out.shape == (n * g * r * micro, 5) and losses.shape == (n * g * r,)
        torch.testing.assert_close(out, ref_out.reshape(-1, 5), **TOL)
        torch.testing.assert_close(losses, ref_losses.reshape(-1), **TOL)
        assert_same_weights(model, ref, rtol=1e-5, atol=1e-5)
    assert training.compile_count == 1


@pytest.mark.parametrize("mode,period", [(OutputMode.All, None), (OutputMode.Final, None), (OutputMode.Sum, None),
                                         (OutputMode.EveryN, 2), (OutputMode.Default, None)])
def test_training_output_modes_with_two_replicas(mode, period):
    n, g, r, micro = 2, 2, 2, 3
    torch.manual_seed(1)
    model = MLP()
    ref = copy.deepcopy(model)
    training = ipuxl.trainingModel(model, _options(n, g, r, mode, period),
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(n * g * r * micro)
    out, loss = training(x, y)
    ref_out, ref_losses = eager_reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, n, micro)
    per_micro = ref_out.reshape(n * g, r, micro, 5)  # (micro-batches in order, replicas, ...)
    per_loss = ref_losses.reshape(n * g, r)
    expected = {
        OutputMode.All: (per_micro.reshape(-1, 5), per_loss.reshape(-1)),
        OutputMode.Final: (per_micro[-1].reshape(r * micro, 5), per_loss[-1]),
        OutputMode.Default: (per_micro[-1].reshape(r * micro, 5), per_loss[-1]),
        OutputMode.Sum: (per_micro.sum(0).reshape(r * micro, 5), per_loss.sum(0)),
        OutputMode.EveryN: (per_micro[1::2].reshape(-1, 5), per_loss[1::2].reshape(-1)),
    }[mode]
    shapes = {OutputMode.All: (24, 8), OutputMode.EveryN: (12, 4)}.get(mode, (6, 2))
    assert (out.shape[0], loss.shape) == (shapes[0], (shapes[1],))
    torch.testing.assert_close(out, expected[0], **TOL)
    torch.testing.assert_close(loss, expected[1], **TOL)


class BNNet(nn.Module):
    """BatchNorm and dropout: eval mode must use the running statistics and no dropout."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


@pytest.mark.parametrize("mode", [OutputMode.All, OutputMode.Final, OutputMode.Sum])
def test_inference_with_two_replicas_equals_eager_eval(mode):
    torch.manual_seed(2)
    net = BNNet()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    n, r, micro = 3, 2, 4
    x, _ = make_data(n * r * micro)
    expected = net.eval()(x).detach()
    opts = Options().deviceIterations(n).replicationFactor(r).outputMode(mode)
    out = ipuxl.inferenceModel(net, opts)(x)
    per_micro = expected.reshape(n, r, micro, 5)
    want = {OutputMode.All: expected, OutputMode.Final: per_micro[-1].reshape(r * micro, 5),
            OutputMode.Sum: per_micro.sum(0).reshape(r * micro, 5)}[mode]
    torch.testing.assert_close(out, want, **TOL)


def test_batch_not_divisible_by_the_replicas_is_refused():
    training = ipuxl.trainingModel(MLP(), Options().deviceIterations(2).replicationFactor(2))
    with raises(BatchSizeError, "replicationFactor 2", "deviceIterations 2", "= 4 parts", "nearest: 4 or 8"):
        training(*make_data(6))
    inference = ipuxl.inferenceModel(nn.Linear(12, 3), Options().replicationFactor(4))
    with raises(BatchSizeError, "replicationFactor 4", "(e.g. 4)"):
        inference(torch.zeros(2, 12))


def test_weights_sync_set_optimizer_and_recompile_with_replicas():
    torch.manual_seed(3)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    training = ipuxl.trainingModel(model, Options().deviceIterations(2).replicationFactor(2), optimizer=opt)
    x, y = make_data(8)
    training(x, y)
    eager_reference(ref, ref_opt, x, y, 2, 2)
    assert_same_weights(model, ref)  # lazy host sync: reading the parameters pulls replica 0's weights
    for group in (opt.param_groups[0], ref_opt.param_groups[0]):
        group["lr"] = 0.05
    training.setOptimizer(opt)  # learning rate only: no recompilation
    training(x, y)
    eager_reference(ref, ref_opt, x, y, 2, 2)
    training.copyWeightsToHost()
    assert_same_weights(model, ref)
    assert training.compile_count == 1
    x2, y2 = make_data(16, seed=5)  # another micro-batch size: recompiles, keeping weights and momentum
    training(x2, y2)
    eager_reference(ref, ref_opt, x2, y2, 2, 4)
    assert training.compile_count == 2
    assert_same_weights(model, ref)
    with torch.no_grad():  # host changes reach every replica through copyWeightsToDevice
        model.fc1.weight.zero_()
        ref.fc1.weight.zero_()
    training.copyWeightsToDevice()
    training(x2, y2)
    eager_reference(ref, ref_opt, x2, y2, 2, 4)
    assert_same_weights(model, ref)


def test_buffers_stay_per_replica_and_read_back_from_replica_zero():
    """BatchNorm running statistics: each replica updates its own from its micro-batches."""

    class Net(BNNet):
        def forward(self, x, y):
            out = self.fc2(torch.relu(self.bn(self.fc1(x))))
            return out, nn.functional.cross_entropy(out, y)

    torch.manual_seed(4)
    net = Net()
    replica0, whole = copy.deepcopy(net), copy.deepcopy(net)
    x, y = make_data(8)
    training = ipuxl.trainingModel(net, Options().replicationFactor(2),
                                   optimizer=torch.optim.SGD(net.parameters(), lr=0.0))
    training(x, y)
    replica0.train()(x[:4], y[:4])  # lr 0: only the running statistics change
    torch.testing.assert_close(net.bn.running_mean, replica0.bn.running_mean, **TOL)
    torch.testing.assert_close(net.bn.running_var, replica0.bn.running_var, **TOL)
    whole.train()(x, y)  # statistics of all 8 samples: not what replica 0 saw
    assert not torch.allclose(net.bn.running_mean, whole.bn.running_mean)


def test_replicas_draw_different_dropout_masks():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(12, 16)

        def forward(self, x):
            out = nn.functional.dropout(self.fc(x), 0.5, training=True)
            return out, out.pow(2).mean()

    x = make_data(4)[0].repeat(2, 1)  # both replicas get the same 4 samples
    training = ipuxl.trainingModel(Drop(), Options().replicationFactor(2).randomSeed(7).outputMode(OutputMode.All))
    out, _ = training(x)
    assert not torch.equal(out[:4] == 0, out[4:] == 0)


# -- DataLoader -----------------------------------------------------------------------
class Indexed(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i % 5


def test_dataloader_combined_batch_feeds_a_replicated_model():
    opts = _options(2, 2, 2)
    loader = ipuxl.DataLoader(opts, Indexed(64), batch_size=2)
    assert loader.combinedBatchSize == 16
    model = ipuxl.trainingModel(nn.Sequential(nn.Linear(1, 5)), opts, loss=nn.CrossEntropyLoss())
    for x, y in loader:
        assert x.shape == (16, 1)
        model(x, y)
    assert model.compile_count == 1


@pytest.mark.parametrize("shuffle", [False, True])
def test_dataloader_shards_are_disjoint_and_cover_the_dataset(shuffle):
    shards = []
    for pid in range(2):
        opts = Options().deviceIterations(2).replicationFactor(2).randomSeed(3)
        opts.Distributed.configureProcessId(pid, 2)
        loader = ipuxl.DataLoader(opts, Indexed(96), batch_size=3, shuffle=shuffle)
        assert loader.combinedBatchSize == 3 * 2 * 2  # this process's 2 replicas (of 4)
        epoch = [torch.cat([x for x, _ in loader]).flatten().long().tolist() for _ in range(2)]
        assert len(epoch[0]) == 48
        assert (epoch[0] != epoch[1]) == shuffle
        shards.append(epoch)
    for e in range(2):
        assert not set(shards[0][e]) & set(shards[1][e])
        assert sorted(shards[0][e] + shards[1][e]) == list(range(96))
    if not shuffle:
        assert shards[0][0] == list(range(48))


def test_dataloader_reads_torchrun_environment(monkeypatch):
    seen = []
    for rank in range(2):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
        opts = Options().replicationFactor(1)  # this process's replicas, as upstream
        assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (rank, 2)
        loader = ipuxl.DataLoader(opts, Indexed(20), batch_size=2)
        assert loader.combinedBatchSize == 2
        seen.append([int(v) for x, _ in loader for v in x.flatten()])
    assert seen == [list(range(10)), list(range(10, 20))]


def test_distributed_option_errors(monkeypatch):
    with raises(OptionsError, "process_id must be an int in [0, 2)"):
        Options().Distributed.configureProcessId(2, 2)
    with raises(OptionsError, "num_processes must be a positive int"):
        Options().Distributed.configureProcessId(0, 0)
    opts = Options().replicationFactor(3)  # 3 replicas in each of the 2 processes (upstream's count)
    opts.Distributed.configureProcessId(0, 2)
    assert ipuxl.DataLoader(opts, Indexed(12), batch_size=1).combinedBatchSize == 3 and opts.total_replicas() == 6
    opts = Options().replicationFactor(2)
    opts.Distributed.configureProcessId(0, 2)
    with raises(OptionsError, "shuffle=True over 2 processes needs options.randomSeed"):
        ipuxl.DataLoader(opts, Indexed(12), batch_size=1, shuffle=True)
    training = ipuxl.trainingModel(MLP(), opts)
    with raises(OptionsError, "configureProcessId(0, 2) does not match this run: process 0 of 1", "torchrun"):
        training(*make_data(4))
    opts = Options().replicationFactor(2)
    opts.Distributed.setEnvVarNames("MY_SIZE", "MY_RANK")
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 1)
    monkeypatch.setenv("MY_SIZE", "4")
    monkeypatch.setenv("MY_RANK", "3")
    assert opts.clone().Distributed.setEnvVarNames("MY_SIZE", "MY_RANK").processId == 3
    assert Options().Distributed.disable().numProcesses == 1


# -- torchrun -------------------------------------------------------------------------
_SCRIPT = """
import sys, torch, ipuxl
sys.path.insert(0, {root!r})
from tests.poptorch_compat.runtime.test_executor import MLP
from ipuxl import Options, OutputMode

data = torch.load({data!r})
rank = int(__import__("os").environ["RANK"])
model = MLP()
model.load_state_dict(data["init"])
opts = Options().deviceIterations(3).replicationFactor(2).outputMode(OutputMode.All)  # per process: 4 in all
opts.anchorTensor("grad", "Gradient___fc2.bias")
training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.Adam(model.parameters(), lr=0.01))
x, y = data["x"], data["y"]  # (steps, replicas, micro, ...): this process feeds its 2 replicas
local = lambda t: t[:, 2 * rank:2 * rank + 2].reshape(-1, *t.shape[3:])
for _ in range(2):
    out, losses = training(local(x), local(y))
torch.save(dict(state=model.state_dict(), out=out, losses=losses, grad=training.getAnchoredTensor("grad")),
           {out!r}.format(rank))
"""


@pytest.mark.slow  # about 30 s: two fresh processes import torch and join a gloo group
def test_torchrun_two_processes_equal_the_in_process_run(tmp_path):
    torch.manual_seed(6)
    model = MLP()
    init = copy.deepcopy(model.state_dict())
    n, r, micro = 3, 4, 2
    x, y = make_data(n * r * micro)
    opts = Options().deviceIterations(n).replicationFactor(r).outputMode(OutputMode.All)
    opts.anchorTensor("grad", "Gradient___fc2.bias")
    training = ipuxl.trainingModel(model, opts, optimizer=torch.optim.Adam(model.parameters(), lr=0.01))
    for _ in range(2):
        out, losses = training(x, y)
    grad = training.getAnchoredTensor("grad")  # (n * r * 5,): iterations, then replicas, concatenated
    torch.save(dict(init=init, x=x.reshape(n, r, micro, -1), y=y.reshape(n, r, micro)), tmp_path / "data.pt")
    root = str(ROOT)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(root=root, data=str(tmp_path / "data.pt"),
                                                     out=str(tmp_path / "rank{}.pt"))))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root, IPUXL_REPLICA_TIMEOUT="60")
    env.pop("WORLD_SIZE", None), env.pop("RANK", None)
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its two workers
        output, _ = process.communicate()
    assert process.returncode == 0, output[-5000:]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got["state"][name], value, rtol=0, atol=0)
        # outputs of this process's replicas only, in its input order
        torch.testing.assert_close(got["out"], out.reshape(n, r, micro, 5)[:, 2 * rank:2 * rank + 2].reshape(-1, 5),
                                   rtol=0, atol=0)
        torch.testing.assert_close(got["losses"], losses.reshape(n, r)[:, 2 * rank:2 * rank + 2].reshape(-1),
                                   rtol=0, atol=0)
        # an anchored tensor (getAnchoredTensor) holds this process's replicas too, as outputs do
        torch.testing.assert_close(got["grad"], grad.reshape(n, r, 5)[:, 2 * rank:2 * rank + 2].reshape(-1),
                                   rtol=0, atol=0)
