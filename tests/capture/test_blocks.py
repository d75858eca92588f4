"""Repeated block modules traced once (``trace_module(..., outline=True)``, on by default
in ``trainingModel``/``inferenceModel``): each kind of block becomes one graph, called
from every place it runs, and autodiff gives it one grad graph. Eager PyTorch is the
oracle, dropout masks included (``DropoutReplay``)."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
from ipuxl.capture.trace import trace_module
from ipuxl.ir.call_op import is_call_graph_node
from ipuxl.ir.calls import CallTarget
from ipuxl.ops.random import modify_seed_impl, offset_seed_impl
from ipuxl.poptorch_compat import DropoutReplay

WIDTH, BATCH = 8, 4


class MLPBlock(nn.Module):
    """A pre-norm transformer-style MLP block: LayerNorm, Linear, GELU, dropout, Linear, residual."""

    def __init__(self, p: float = 0.25):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.p = p

    def forward(self, x):
        h = F.dropout(F.gelu(self.up(self.norm(x))), self.p, self.training)
        return x + self.down(h)


class Stack(nn.Module):
    def __init__(self, blocks: list, head_dropout: float = 0.1):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(WIDTH, 3)
        self.p = head_dropout

    def forward(self, x, y):
        out = self.head(F.dropout(self.blocks(x), self.p, self.training))
        return out, F.cross_entropy(out, y)


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, WIDTH, generator=g), torch.randint(0, 3, (n,), generator=g)


def _assert_same_weights(net: nn.Module, ref: nn.Module, rtol: float = 1e-5) -> None:
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), rtol=rtol, atol=1e-6)


def _check_one_sgd_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor, random_seed: int | None = None):
    """One ``trainingModel`` call (SGD, lr 0.1) against one eager step of a copy (with the
    device's dropout masks when ``random_seed`` is given); returns the eager copy."""
    ref = copy.deepcopy(net)
    opts = ipuxl.Options() if random_seed is None else ipuxl.Options().randomSeed(random_seed)
    model = ipuxl.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    _, loss = model(x, y)
    with contextlib.nullcontext() if random_seed is None else DropoutReplay(random_seed).step():
        _, ref_loss = ref(x, y)
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_same_weights(net, ref)
    return ref


def _calls(graph, name: str) -> int:
    return sum(1 for n in graph.fx.nodes if isinstance(n.target, CallTarget) and n.target.graph.base_name == name)


def _graph(model, base_name: str):
    return next(g for g in model._session.ir.graphs if g.base_name == base_name)


@pytest.mark.parametrize("outline,accumulation", [(True, 1), (False, 1), (True, 2)],
                         ids=["outlined", "inlined", "outlined-accumulation"])
def test_dropout_blocks_train_like_eager_with_the_device_masks(outline, accumulation):
    torch.manual_seed(0)
    net = Stack([MLPBlock() for _ in range(4)])
    ref = copy.deepcopy(net)
    opts = ipuxl.Options().deviceIterations(2).randomSeed(7).autoOutline(outline)
    opts.Training.gradientAccumulation(accumulation)
    model = ipuxl.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    replay = DropoutReplay(7, accumulation)
    for call in range(2):
        x, y = _data(2 * accumulation * BATCH, call)
        _, losses = model(x, y)
        for xs, ys in zip(x.split(accumulation * BATCH), y.split(accumulation * BATCH)):
            ref_opt.zero_grad()
            for xm, ym in zip(xs.split(BATCH), ys.split(BATCH)):
                with replay.step():
                    _, loss = ref(xm, ym)
                (loss / accumulation).backward()
            ref_opt.step()
        assert_close(losses, loss.detach(), rtol=1e-5, atol=1e-6)  # training's default output: the last micro-batch's
    _assert_same_weights(net, ref)
    names = {g.base_name for g in model._session.ir.graphs}
    if outline:  # one block graph and one grad graph, called once per block
        assert {"MLPBlock", "MLPBlock_grad"} <= names
        assert _calls(_graph(model, "Stack"), "MLPBlock") == 4
        assert _calls(_graph(model, "Stack_grad"), "MLPBlock_grad") == 4
    else:
        assert "MLPBlock" not in names


def test_batchnorm_blocks_update_their_running_statistics():
    class BNBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(WIDTH, WIDTH)
            self.bn = nn.BatchNorm1d(WIDTH)

        def forward(self, x):
            return x + torch.relu(self.bn(self.fc(x)))

    torch.manual_seed(1)
    net = Stack([BNBlock() for _ in range(3)], head_dropout=0.0)
    ref = copy.deepcopy(net)
    model = ipuxl.trainingModel(net, ipuxl.Options().deviceIterations(3),
                                optimizer=torch.optim.SGD(net.parameters(), lr=0.05))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    x, y = _data(3 * BATCH, 3)
    model(x, y)
    for xs, ys in zip(x.split(BATCH), y.split(BATCH)):
        ref_opt.zero_grad()
        ref(xs, ys)[1].backward()
        ref_opt.step()
    model.copyWeightsToHost()
    assert _calls(_graph(model, "Stack"), "BNBlock") == 3
    ref_buffers = dict(ref.named_buffers())
    for name, buf in net.named_buffers():
        assert_close(buf, ref_buffers[name], rtol=1e-5, atol=1e-6)
    _assert_same_weights(net, ref)
    # in eval mode the blocks read the running statistics: also one graph, called 3 times
    net.eval()
    ref.eval()
    x, y = _data(BATCH, 4)
    inference = ipuxl.inferenceModel(net)
    assert_close(inference(x, y)[0], ref(x, y)[0], rtol=1e-5, atol=1e-6)
    assert _calls(_graph(inference, "Stack"), "BNBlock") == 3


class Scaled(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.scale = scale

    def forward(self, x):
        return x + self.scale * torch.tanh(self.fc(x))


def _trace(net: nn.Module, outline: bool = True):
    x, y = _data(BATCH, 0)
    return trace_module(net, (x, y), training=True, need_loss=True, outline=outline)


def _aten_nodes(traced) -> int:
    return sum(1 for n in traced.gm.graph.nodes
               if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten")


@pytest.mark.parametrize("discovery", [True, False], ids=["meta-discovery", "traced-retries"])
def test_each_kind_of_block_is_traced_once_whatever_the_depth(discovery, monkeypatch):
    import ipuxl.capture.trace as trace_mod

    if not discovery:  # what happens when the model cannot run on meta tensors
        monkeypatch.setattr(trace_mod, "discover_blocks", lambda *args: None)
    traced_modules = []
    real_trace = trace_mod._trace
    monkeypatch.setattr(trace_mod, "_trace", lambda module, *a, **k: traced_modules.append(type(module).__name__)
                        or real_trace(module, *a, **k))
    shallow, deep = _trace(Stack([MLPBlock() for _ in range(2)])), _trace(Stack([MLPBlock() for _ in range(9)]))
    # the block alone once, the model once (plus, without discovery, one attempt stopped at the first block)
    assert traced_modules.count("MLPBlock") == 2
    assert traced_modules.count("Stack") == (2 if discovery else 4)
    assert [len(t.blocks) for t in (shallow, deep)] == [1, 1]
    assert sum(map(is_call_graph_node, deep.gm.graph.nodes)) == 9
    assert _aten_nodes(shallow) == _aten_nodes(deep)  # the head, its dropout and the loss only
    # each call's dropout seed: the model's seed shifted past the dropouts before it
    assert sum(n.target is torch.ops.ipuxl.offset_seed.default for n in deep.gm.graph.nodes) == 9
    inlined = _trace(Stack([MLPBlock() for _ in range(9)]), outline=False)
    assert not inlined.blocks and _aten_nodes(inlined) > 9 * 5


def test_discovery_runs_each_kind_of_block_once(monkeypatch):
    """Block discovery's dry run runs the first of each kind's runs; the later ones (same
    structure and input specs) give fake tensors like its outputs, and are still counted."""
    import ipuxl.capture.trace as trace_mod

    runs: list[int] = []
    real_discover = trace_mod.discover_blocks

    def discover(module, args, kwargs, candidates, blocks, trace_block):
        calls: list[int] = []
        real_forward = MLPBlock.forward

        def counted(self, x):
            calls.append(1)
            return real_forward(self, x)

        def trace_alone(need):  # the block's own trace is not the dry run's
            before = len(calls)
            try:
                return trace_block(need)
            finally:
                del calls[before:]

        with monkeypatch.context() as patch:
            patch.setattr(MLPBlock, "forward", counted)
            real_discover(module, args, kwargs, candidates, blocks, trace_alone)
        runs.append(len(calls))

    monkeypatch.setattr(trace_mod, "discover_blocks", discover)
    traced = _trace(Stack([MLPBlock() for _ in range(5)]))
    assert runs == [1]
    assert sum(map(is_call_graph_node, traced.gm.graph.nodes)) == 5  # all five counted: the kind is outlined


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(WIDTH, WIDTH, 1), nn.Conv2d(WIDTH, WIDTH, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(torch.relu(self.conv1(x))) * 0.5


class ConvStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[ConvBlock() for _ in range(4)])
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x, y):
        out = self.head(self.blocks(x).mean((2, 3)))
        return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels-last"])
def test_discovery_finds_blocks_in_the_layout_the_trace_meets(monkeypatch, memory_format):
    """Discovery runs on fake CPU tensors, whose convolutions keep channels-last as the trace's
    do: the model is traced once after its one kind of block (no restart)."""
    import ipuxl.capture.trace as trace_mod

    traced_modules = []
    real_trace = trace_mod._trace
    monkeypatch.setattr(trace_mod, "_trace", lambda module, *a, **k: traced_modules.append(type(module).__name__)
                        or real_trace(module, *a, **k))
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(BATCH, WIDTH, 6, 6, generator=g).contiguous(memory_format=memory_format)
    y = torch.randint(0, 3, (BATCH,), generator=g)
    traced = trace_module(ConvStack(), (x, y), training=True, need_loss=True, outline=True)
    assert traced_modules == ["ConvBlock", "ConvStack"]
    assert sum(map(is_call_graph_node, traced.gm.graph.nodes)) == 4


def test_alike_blocks_run_once_each_on_other_shapes_stay_inline(monkeypatch):
    """Two alike blocks, one run before and one after a pooling (DenseNet's layers across its
    dense blocks): discovery sees each kind run once, so neither is traced alone or called."""
    import ipuxl.capture.trace as trace_mod

    class TwoScales(nn.Module):
        def __init__(self):
            super().__init__()
            self.fine, self.coarse = ConvBlock(), ConvBlock()
            self.head = nn.Linear(WIDTH, 3)

        def forward(self, x, y):
            h = self.coarse(F.avg_pool2d(self.fine(x), 2))
            out = self.head(h.mean((2, 3)))
            return out, F.cross_entropy(out, y)

    traced_modules = []
    real_trace = trace_mod._trace
    monkeypatch.setattr(trace_mod, "_trace", lambda module, *a, **k: traced_modules.append(type(module).__name__)
                        or real_trace(module, *a, **k))
    torch.manual_seed(6)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(BATCH, WIDTH, 6, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    net = TwoScales()
    traced = trace_module(net, (x, y), training=True, need_loss=True, outline=True)
    assert traced_modules == ["TwoScales"] and not traced.blocks
    _check_one_sgd_step(net, x, y)


def test_torch_layers_are_never_traced_as_blocks(monkeypatch):
    """Identical sibling ``Linear``/``BatchNorm1d``/``ReLU`` layers (one functional call each) are
    traced inline, not each kind alone first; a repeated block of them still is a block."""
    import ipuxl.capture.trace as trace_mod

    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
            self.bn1, self.bn2 = nn.BatchNorm1d(WIDTH), nn.BatchNorm1d(WIDTH)
            self.act1, self.act2 = nn.ReLU(), nn.ReLU()
            self.blocks = nn.Sequential(*[MLPBlock(0.0) for _ in range(3)])
            self.head = nn.Linear(WIDTH, 3)

        def forward(self, x, y):
            h = self.act2(self.bn2(self.fc2(self.act1(self.bn1(self.fc1(x))))))
            out = self.head(self.blocks(h))
            return out, F.cross_entropy(out, y)

    traced_modules = []
    real_trace = trace_mod._trace
    monkeypatch.setattr(trace_mod, "_trace", lambda module, *a, **k: traced_modules.append(type(module).__name__)
                        or real_trace(module, *a, **k))
    torch.manual_seed(4)
    net = Layers()
    traced = _trace(net)
    assert sorted(traced_modules) == ["Layers", "MLPBlock"]
    assert [b.traced.name for b in traced.blocks] == ["MLPBlock"]
    _check_one_sgd_step(net, *_data(BATCH, 7))


def test_blocks_that_differ_in_an_attribute_get_graphs_of_their_own():
    torch.manual_seed(2)
    net = Stack([Scaled(0.5), Scaled(0.25), Scaled(0.5), Scaled(0.25), Scaled(0.5), Scaled(0.25)], head_dropout=0.0)
    traced = _trace(net)
    assert len(traced.blocks) == 2
    _check_one_sgd_step(net, *_data(BATCH, 5))
    # one of a kind is not outlined
    assert not _trace(Stack([Scaled(0.5), Scaled(0.25)] + [nn.Identity()] * 2)).blocks


class WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x.mul_(0.5)  # the caller's tensor changes
        return torch.tanh(self.fc(x)) * 2.0 + 1.0


class Hooked(Scaled):
    def __init__(self):
        super().__init__(0.5)
        self.register_forward_hook(lambda module, args, out: out * 2.0)


class LossInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return h + F.mse_loss(h, x) * 0.0 + 1.0


@pytest.mark.parametrize("block", [lambda: nn.Linear(WIDTH, WIDTH), WritesInput, Hooked, LossInside],
                         ids=["too-small", "writes-its-input", "hooked", "loss-inside"])
def test_blocks_that_cannot_be_outlined_are_traced_inline(block):
    torch.manual_seed(3)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([block() for _ in range(4)])
            self.head = nn.Linear(WIDTH, 3)

        def forward(self, x, y):
            for b in self.blocks:
                x = b(x.clone() if isinstance(b, WritesInput) else x)
            out = self.head(x)
            return out, F.cross_entropy(out, y)

    net = Net()
    assert not _trace(net).blocks
    _check_one_sgd_step(net, *_data(BATCH, 6))


def test_offset_seed_shifts_the_seed_modifier():
    seed = torch.tensor([12345, 2**31 - 7])
    for offset in (0, 1, 3, 1000):
        for j in (1, 2, 17):
            assert torch.equal(modify_seed_impl(offset_seed_impl(seed, offset), j), modify_seed_impl(seed, offset + j))


class Gated(nn.Module):
    """Keyword and non-tensor arguments, a tuple result."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, *, scale: float, gate_input=None):
        g = torch.sigmoid(self.gate(x if gate_input is None else gate_input))
        return x + scale * g * torch.tanh(self.fc(x)), g.mean()


def test_blocks_with_keyword_arguments_tuple_results_and_frozen_weights():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Gated() for _ in range(4)])
            self.head = nn.Linear(WIDTH, 3)

        def forward(self, x, y):
            gates = []
            first = x
            for i, block in enumerate(self.blocks):
                x, g = block(x, scale=0.5 if i % 2 else 0.25, gate_input=first)
                gates.append(g)
            out = self.head(x)
            return out, F.cross_entropy(out, y) + 0.1 * torch.stack(gates).sum()

    torch.manual_seed(4)
    net = Net()
    net.blocks[1].fc.weight.requires_grad_(False)  # a frozen weight inside one block
    # two static scales: two kinds of call of the same block structure
    assert len(_trace(net).blocks) == 2
    ref = copy.deepcopy(net)
    model = ipuxl.trainingModel(net, ipuxl.Options().deviceIterations(2),
                                optimizer=torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1))
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    x, y = _data(2 * BATCH, 8)
    model(x, y)
    for xs, ys in zip(x.split(BATCH), y.split(BATCH)):
        ref_opt.zero_grad()
        ref(xs, ys)[1].backward()
        ref_opt.step()
    _assert_same_weights(net, ref)


@pytest.mark.parametrize("outline", [True, False], ids=["outlined", "inlined"])
def test_transformer_encoder_layers_with_dropout_train_like_eager_with_the_device_masks(outline):
    """torch's own TransformerEncoderLayer, three of them, dropout on everywhere: the
    attention dropout inside F.scaled_dot_product_attention is seeded like F.dropout.
    Outlined: one layer graph and one grad graph, and no graph between the layers (the
    per-layer seed offsets stay plain ops of the forward)."""
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.2, batch_first=True)
                                         for _ in range(3)])
            self.head = nn.Linear(WIDTH, 3)

        def forward(self, x, y):
            for layer in self.layers:
                x = layer(x)
            out = self.head(x.mean(1))
            return out, F.cross_entropy(out, y)

    torch.manual_seed(5)
    net = Encoder()
    ref = copy.deepcopy(net)
    opts = ipuxl.Options().deviceIterations(2).randomSeed(11).autoOutline(outline)
    model = ipuxl.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    replay = DropoutReplay(11)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(2 * BATCH, 5, WIDTH, generator=g), torch.randint(0, 3, (2 * BATCH,), generator=g)
    _, loss = model(x, y)
    for xs, ys in zip(x.split(BATCH), y.split(BATCH)):
        ref_opt.zero_grad()
        with replay.step():
            _, ref_loss = ref(xs, ys)
        ref_loss.backward()
        ref_opt.step()
    assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_same_weights(net, ref, rtol=1e-4)
    if outline:
        assert _calls(_graph(model, "Encoder"), "TransformerEncoderLayer") == 3
        assert _calls(_graph(model, "Encoder_grad"), "TransformerEncoderLayer_grad") == 3
        assert [g.base_name for g in model._session.ir.graphs].count("Encoder_ops") == 1  # the head


class CausalAttention(nn.Module):
    """F.scaled_dot_product_attention called directly, with a mask, causal, with dropout."""

    def __init__(self, causal: bool):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.causal = causal

    def forward(self, x, y):
        q, k, v = self.qkv(x).reshape(x.shape[0], x.shape[1], 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        mask = None if self.causal else torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(-1)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3 if self.training else 0.0,
                                           is_causal=self.causal)
        out = h.mean((1, 2))[:, :3]
        return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bool-mask"])
def test_attention_dropout_is_seeded_and_replayed(causal):
    torch.manual_seed(7)
    net = CausalAttention(causal)
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(BATCH, 6, WIDTH, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    ref = _check_one_sgd_step(net, x, y, random_seed=3)
    net.eval()
    ref.eval()  # no dropout: torch's fused kernel, as eager
    assert_close(ipuxl.inferenceModel(net)(x, y)[0], ref(x, y)[0], rtol=1e-5, atol=1e-6)


class Scratch:
    """A per-call object handed to every block (as Hugging Face hands its ``Cache``): equal only
    to itself."""

    def __init__(self):
        self.seen = 0


class ScratchBlock(MLPBlock):
    def forward(self, x, scratch):
        scratch.seen += 1
        return super().forward(x)


class ScratchStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ScratchBlock(p=0.0) for _ in range(3)])
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x, y):
        scratch = Scratch()
        for block in self.blocks:
            x = block(x, scratch)
        out = self.head(x)
        return out, F.cross_entropy(out, y)


def _count_traces(monkeypatch) -> list[str]:
    import ipuxl.capture.trace as trace_mod

    traced_modules: list[str] = []
    real_trace = trace_mod._trace
    monkeypatch.setattr(trace_mod, "_trace", lambda module, *a, **k: traced_modules.append(type(module).__name__)
                        or real_trace(module, *a, **k))
    return traced_modules


def test_blocks_given_a_per_call_object_run_inline(monkeypatch):
    """Each run's object is new, so no run can reuse a traced kind: the blocks run inline,
    and the model is traced once (it was traced again at every run, for ever)."""
    traced_modules = _count_traces(monkeypatch)
    torch.manual_seed(7)
    x, y = _data(BATCH, 7)
    traced = trace_module(ScratchStack(), (x, y), training=True, need_loss=True, outline=True)
    assert traced_modules == ["ScratchStack"] and not traced.blocks
    torch.manual_seed(7)
    _check_one_sgd_step(ScratchStack(), x, y)


def test_a_trace_that_keeps_meeting_new_kinds_of_blocks_is_traced_without_outlining(monkeypatch):
    """Should runs of a block never match a traced kind (here: the per-call object taken for
    comparable), the trace gives up outlining after a bounded number of restarts."""
    import ipuxl.capture.blocks as blocks_mod

    monkeypatch.setattr(blocks_mod, "_comparable", lambda value: True)
    traced_modules = _count_traces(monkeypatch)
    torch.manual_seed(7)
    x, y = _data(BATCH, 7)
    traced = trace_module(ScratchStack(), (x, y), training=True, need_loss=True, outline=True)
    assert not traced.blocks
    assert traced_modules.count("ScratchStack") > 1 and traced_modules[-1] == "ScratchStack"
    assert len(traced_modules) < 40
