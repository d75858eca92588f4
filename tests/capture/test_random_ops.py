"""torch's random functions inside PopTorch models, drawn from ``Options.randomSeed``.

Eager torch is the oracle: the device's draws have torch's distribution (statistics
over many samples), dtype and shape; ``DropoutReplay`` makes eager torch draw exactly
what the device draws, so outputs, gradients and trained weights compare exactly.
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.distributions as D
import torch.nn as nn
import torch.nn.functional as F

import ipuxl
from ipuxl import Options, OutputMode
from ipuxl.errors import TraceError
from tests.poptorch_compat._checks import as_poptorch
from ipuxl.poptorch_compat import DropoutReplay

from tests.poptorch_compat._checks import raises_in

raises = raises_in(__file__)
N = 20000  # samples per statistic: the standard error of a mean is about 0.7% of the std


class Draw(nn.Module):
    """Returns ``draw(x)``: a random function of the input batch ``x``."""

    def __init__(self, draw: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.draw(x)


# name -> (draw, statistics compared with eager torch's)
def _mean(t: torch.Tensor) -> torch.Tensor:
    return t.double().mean()


def _std(t: torch.Tensor) -> torch.Tensor:
    return t.double().std()


def _min(t: torch.Tensor) -> torch.Tensor:
    return t.double().min()


def _max(t: torch.Tensor) -> torch.Tensor:
    return t.double().max()


DRAWS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], list[Callable]]] = {
    "rand": (lambda x: torch.rand(x.shape[0], N), [_mean, _std, _min, _max]),
    "randn": (lambda x: torch.randn(x.shape[0], N), [_mean, _std]),
    "rand_like": (lambda x: torch.rand_like(x.expand(-1, N)), [_mean, _std]),
    "randn_like": (lambda x: torch.randn_like(x.expand(-1, N)) * 2 + 1, [_mean, _std]),
    "randint": (lambda x: torch.randint(3, 9, (x.shape[0], N)), [_mean, _std, _min, _max]),
    "normal_floats": (lambda x: torch.normal(2.0, 3.0, (x.shape[0], N)), [_mean, _std]),
    "normal_tensor_mean": (lambda x: torch.normal(x.expand(-1, N) + 4.0, 0.5), [_mean, _std]),
    "normal_": (lambda x: torch.empty(x.shape[0], N).normal_(1.0, 2.0), [_mean, _std]),
    "uniform_": (lambda x: x.new_empty(x.shape[0], N).uniform_(-2, 3), [_mean, _std, _min, _max]),
    "exponential_": (lambda x: torch.empty(x.shape[0], N).exponential_(2.0), [_mean, _std]),
    "bernoulli_": (lambda x: torch.empty(x.shape[0], N).bernoulli_(0.3), [_mean]),
    "bernoulli_tensor": (lambda x: torch.bernoulli(torch.full((x.shape[0], N), 0.7)), [_mean]),
    "multinomial": (lambda x: torch.multinomial(torch.tensor([1.0, 2.0, 7.0]), N, True).expand(x.shape[0], -1),
                    [_mean, _std]),
    "poisson": (lambda x: torch.poisson(torch.full((x.shape[0], N), 3.0)), [_mean, _std]),
    "randperm": (lambda x: torch.randperm(N).expand(x.shape[0], -1).float(), [_mean, _std, _min, _max]),
    "distributions_normal": (lambda x: D.Normal(x[:, 0] * 0 + 5.0, 2.0).sample((N,)), [_mean, _std]),
    "distributions_uniform": (lambda x: D.Uniform(0.0, 10.0).sample((x.shape[0], N)), [_mean, _std, _min, _max]),
    "distributions_exponential": (lambda x: D.Exponential(torch.tensor(0.5)).sample((x.shape[0], N)), [_mean]),
    "categorical": (lambda x: D.Categorical(probs=torch.tensor([0.1, 0.6, 0.3])).sample((x.shape[0], N)),
                    [_mean, _std]),
    "gamma": (lambda x: D.Gamma(torch.tensor(2.0), torch.tensor(1.0)).sample((x.shape[0], N)), [_mean, _std]),
    "dirichlet": (lambda x: D.Dirichlet(torch.tensor([1.0, 2.0, 5.0])).sample((x.shape[0], N)), [_mean, _std]),
    "alpha_dropout": (lambda x: F.alpha_dropout(x.expand(-1, N) * 0 + 1.0, 0.3, True), [_mean, _std]),
    "torch_dropout": (lambda x: torch.dropout(x.expand(-1, N) * 0 + 1.0, 0.3, True), [_mean, _std]),
    "feature_dropout": (lambda x: torch.feature_dropout(x.expand(-1, N).reshape(-1, N // 4, 4) * 0 + 1.0, 0.3,
                                                        True), [_mean, _std]),
    "beta": (lambda x: D.Beta(torch.tensor(2.0), torch.tensor(3.0)).rsample((x.shape[0], N)), [_mean, _std]),
}


@pytest.mark.parametrize("name", list(DRAWS))
def test_draws_have_torchs_distribution_dtype_and_shape_and_replay_exactly(name):
    draw, statistics = DRAWS[name]
    x = torch.zeros(2, 1)
    device = ipuxl.inferenceModel(Draw(draw), Options().randomSeed(8))(x)
    torch.manual_seed(0)
    eager = as_poptorch(draw(x))  # int64 draws come back int32, as from PopTorch
    assert device.shape == eager.shape and device.dtype == eager.dtype
    with DropoutReplay(8).step():
        torch.testing.assert_close(device, as_poptorch(draw(x)), rtol=0, atol=0)  # eager can replay the device's draw
    for statistic in statistics:
        # 3% of the spread (or 0.02 absolute): several standard errors at N samples
        torch.testing.assert_close(statistic(device), statistic(eager), rtol=0.03, atol=0.02,
                                   msg=f"{name}: {statistic.__name__}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_in_place_draws_keep_the_input_dtype(dtype):
    def draw(x):
        return x.normal_(mean=20.0, std=8.0)

    x = torch.ones(3, 4000, dtype=dtype)
    out = ipuxl.inferenceModel(Draw(draw), Options().randomSeed(8))(x.clone())
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float().mean(), torch.tensor(20.0), rtol=0.03, atol=0.0)
    torch.testing.assert_close(out.float().std(), torch.tensor(8.0), rtol=0.03, atol=0.0)


def _noisy(x: torch.Tensor) -> torch.Tensor:
    """Several kinds of draw in one model (each takes the next seed)."""
    keep = torch.empty(x.shape[0], 1).bernoulli_(0.5)
    return torch.cat([x + torch.randn_like(x), torch.rand(x.shape[0], 3) * keep,
                      torch.randint(0, 100, (x.shape[0], 2)).float(), D.Normal(x, 1.0).sample()], dim=1)


def test_draws_are_reproducible_under_random_seed():
    x = torch.randn(4, 3)
    first = ipuxl.inferenceModel(Draw(_noisy), Options().randomSeed(42))(x)
    again = ipuxl.inferenceModel(Draw(_noisy), Options().randomSeed(42))(x)
    other = ipuxl.inferenceModel(Draw(_noisy), Options().randomSeed(43))(x)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, other)


def test_draws_are_fresh_every_device_iteration_and_call():
    x = torch.zeros(2, 3).repeat(4, 1)  # the same micro-batch for 4 device iterations
    opts = Options().deviceIterations(4).randomSeed(1).outputMode(OutputMode.All)
    model = ipuxl.inferenceModel(Draw(_noisy), opts)
    first, second = model(x), model(x)
    steps = first.reshape(4, 2, -1)
    for i in range(4):
        for j in range(i):
            assert not torch.equal(steps[i], steps[j])
    assert not torch.equal(first, second)


def test_draws_differ_per_replica():
    x = torch.zeros(2, 3).repeat(2, 1)  # 2 replicas, the same micro-batch each
    out = ipuxl.inferenceModel(Draw(_noisy), Options().replicationFactor(2).randomSeed(3))(x)
    replicas = out.reshape(2, 2, -1)
    assert not torch.equal(replicas[0], replicas[1])


def test_eager_replay_draws_exactly_what_the_device_draws():
    x = torch.randn(2, 3).repeat(3, 1)
    opts = Options().deviceIterations(3).randomSeed(9).outputMode(OutputMode.All)
    model = ipuxl.inferenceModel(Draw(_noisy), opts)
    device = torch.cat([model(x), model(x)])
    replay = DropoutReplay(9)
    eager = []
    for _ in range(6):
        with replay.step():
            eager.append(_noisy(x[:2]))
    torch.testing.assert_close(device, torch.cat(eager), rtol=0, atol=0)


def test_a_generator_argument_is_ignored_as_in_poptorch():
    def with_generator(x):
        return torch.rand(x.shape[0], 5, generator=torch.Generator().manual_seed(0)) + x.sum()

    def without(x):
        return torch.rand(x.shape[0], 5) + x.sum()

    x = torch.zeros(2, 1)
    a = ipuxl.inferenceModel(Draw(with_generator), Options().randomSeed(4))(x)
    b = ipuxl.inferenceModel(Draw(without), Options().randomSeed(4))(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- training: StochasticDepth, rsample, rrelu against eager with the device's draws -------------
class Residual(nn.Module):
    def __init__(self, width: int, p: float):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.depth = _stochastic_depth(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.depth(torch.relu(self.fc(x)))


def _stochastic_depth(p: float) -> nn.Module:
    torchvision_ops = pytest.importorskip("torchvision.ops")
    return torchvision_ops.StochasticDepth(p, mode="row")


class DeepNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(Residual(8, 0.4) for _ in range(3)))
        self.head = nn.Linear(8, 4)
        self.act = nn.RReLU()
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.act(self.blocks(x)))
        return out, self.loss(out, y)


class Reparameterised(nn.Module):
    """Learns loc and scale through ``Normal.rsample`` (pathwise gradients)."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
        self.log_scale = nn.Parameter(torch.zeros(3))

    def forward(self, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sample = D.Normal(self.loc, self.log_scale.exp()).rsample((target.shape[0],))
        return sample, ipuxl.identity_loss(((sample - target) ** 2).mean(), "none")


class BetaReparameterised(nn.Module):
    """Learns Beta's concentrations through ``Beta.rsample`` (torch's Dirichlet gradient)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1.5, 2.0, 3.0]))
        self.b = nn.Parameter(torch.tensor([2.5, 1.0, 0.5]))

    def forward(self, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sample = D.Beta(self.a, self.b).rsample((target.shape[0],))
        return sample, ipuxl.identity_loss(((sample - target / 3) ** 2).mean(), "none")


class GammaReparameterised(nn.Module):
    """Learns a concentration through ``Gamma.rsample`` (torch's implicit gradient)."""

    def __init__(self):
        super().__init__()
        self.concentration = nn.Parameter(torch.tensor([1.5, 2.0, 3.0]))

    def forward(self, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sample = D.Gamma(self.concentration, 1.0).rsample((target.shape[0],))
        return sample, ipuxl.identity_loss(((sample - target) ** 2).mean(), "none")


def _train_both(net: nn.Module, data: list[tuple[torch.Tensor, ...]], accumulation: int, seed: int):
    """The device's weights after training on ``data`` (one call per item), and eager torch's
    with the same draws (``DropoutReplay``)."""
    ref = copy.deepcopy(net)
    iterations = 2
    opts = Options().deviceIterations(iterations).randomSeed(seed)
    opts.Training.gradientAccumulation(accumulation)
    training = ipuxl.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    replay = DropoutReplay(seed, accumulation)
    for batch in data:
        training(*batch)
        for step in zip(*(t.chunk(iterations) for t in batch)):
            ref_opt.zero_grad()
            for micro in zip(*(t.chunk(accumulation) for t in step)):
                with replay.step():
                    (ref(*micro)[1] / accumulation).backward()
            ref_opt.step()
    return net, ref


@pytest.mark.parametrize("rnn", [nn.GRU, nn.LSTM, nn.RNN])
def test_recurrent_dropout_between_layers_trains_as_eager_with_the_same_masks(rnn):
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = rnn(4, 6, num_layers=3, dropout=0.4, bidirectional=rnn is nn.LSTM)
            self.head = nn.Linear(6 * (2 if rnn is nn.LSTM else 1), 3)
            self.loss = nn.CrossEntropyLoss()

        def forward(self, x, y):
            out = self.head(self.rnn(x.transpose(0, 1))[0][-1])
            return out, self.loss(out, y)

    torch.manual_seed(3)
    data = [(torch.randn(8, 5, 4), torch.randint(0, 3, (8,))) for _ in range(2)]
    net, ref = _train_both(Recurrent(), data, 1, seed=4)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_stochastic_depth_and_rrelu_train_as_eager_with_the_same_masks(accumulation):
    torch.manual_seed(0)
    batch = 4 * 2 * accumulation
    data = [(torch.randn(batch, 8), torch.randint(0, 4, (batch,))) for _ in range(3)]
    net, ref = _train_both(DeepNet(), data, accumulation, seed=5)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.equal(net.head.weight, DeepNet().head.weight)


def _check_trained_as_eager(model: nn.Module, seed: int) -> None:
    torch.manual_seed(1)
    start = copy.deepcopy(model)
    data = [(torch.rand(8, 3) + 1.0,) for _ in range(3)]
    net, ref = _train_both(model, data, 1, seed=seed)
    for (name, p), q, s in zip(net.named_parameters(), ref.parameters(), start.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
        assert not torch.allclose(p, s), f"{name} was not trained"


def test_rsample_gradients_flow_to_loc_and_scale_as_in_eager():
    _check_trained_as_eager(Reparameterised(), seed=6)


def test_beta_rsample_gradients_flow_to_both_concentrations_as_in_eager():
    _check_trained_as_eager(BetaReparameterised(), seed=8)


def test_gamma_rsample_gradient_flows_to_the_concentration_as_in_eager():
    _check_trained_as_eager(GammaReparameterised(), seed=7)


def test_normal_bernoulli_and_poisson_give_their_tensor_arguments_zero_gradients_as_in_torch():
    """A zero gradient, not none: weight decay still moves those parameters, as in eager."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mean = nn.Parameter(torch.ones(4))
            self.p = nn.Parameter(torch.full((4,), 0.5))
            self.rate = nn.Parameter(torch.full((4,), 2.0))

        def forward(self, x):
            noisy = torch.normal(self.mean, 1.0) + torch.bernoulli(self.p.expand(x.shape[0], -1))
            return ipuxl.identity_loss((noisy * x + torch.poisson(self.rate)).mean(), "none")

    net = Net()
    ref = copy.deepcopy(net)
    x = torch.randn(4, 4)
    training = ipuxl.trainingModel(net, Options().randomSeed(2),
                                   optimizer=torch.optim.SGD(net.parameters(), lr=0.5, weight_decay=0.1))
    training(x)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, weight_decay=0.1)
    ref(x).backward()  # eager torch's own draws: these gradients do not depend on them
    ref_opt.step()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert q.grad is not None and not q.grad.any()
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        assert not torch.equal(p, Net().get_parameter(name))


def test_outlined_blocks_draw_what_the_inlined_model_draws():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            return torch.relu(self.fc(x)) * torch.empty(x.shape[0], 1).bernoulli_(0.7) + torch.randn_like(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(4)))

        def forward(self, x):
            return self.blocks(x + torch.rand_like(x))

    torch.manual_seed(2)
    net, x = Net(), torch.randn(3, 6)
    outlined = ipuxl.inferenceModel(net, Options().randomSeed(4))(x)
    inline = ipuxl.inferenceModel(copy.deepcopy(net), Options().randomSeed(4).autoOutline(False))(x)
    torch.testing.assert_close(outlined, inline, rtol=1e-6, atol=1e-6)


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("draw, fragments", [
    (lambda x: torch.rand(x.shape[0], 3, dtype=torch.int64), ("torch.rand", "floating", "torch.int64")),
    (lambda x: torch.multinomial(torch.ones(3), 5), ("torch.multinomial", "5 > 3", "replacement=True")),
    (lambda x: x.uniform_(2.0, 1.0), ("uniform_", "from <= to", "from=2.0")),
    (lambda x: torch.randint(5, 5, (2,)), ("torch.randint", "low=5, high=5")),
    (lambda x: torch.normal(0.0, -1.0, (2,)), ("torch.normal", "std must be >= 0.0")),
])
def test_bad_arguments_raise_runtime_errors_as_torch(draw, fragments):
    with pytest.raises(RuntimeError):  # eager torch's error type for the same mistake
        draw(torch.zeros(2, 1))
    with raises(TraceError, *fragments) as info:
        ipuxl.inferenceModel(Draw(draw), Options())(torch.zeros(2, 1))
    assert isinstance(info.value, RuntimeError)


def test_aten_random_ops_are_refused_with_the_op_named():
    def aten_bernoulli(x):
        return torch.ops.aten.bernoulli.p(x, 0.5)

    with pytest.raises(TraceError, match="aten.bernoulli") as info:
        ipuxl.inferenceModel(Draw(aten_bernoulli), Options())(torch.zeros(2, 3))
    assert "Options.randomSeed" in str(info.value) and "torch.rand" in info.value.fix


def test_rrelu_in_eval_is_deterministic_as_in_torch():
    x = torch.randn(4, 10)
    out = ipuxl.inferenceModel(nn.RReLU(0.1, 0.3))(x)
    torch.testing.assert_close(out, F.rrelu(x, 0.1, 0.3, training=False))
