"""``device.retarget``: programs traced on the host, compiled for another device. Without a
GPU the rewritten graphs are checked by what they name (``meta`` stands in for the device)
and by running the portable attention on the CPU against eager PyTorch."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import assert_close

import ipuxl
import ipuxl.device.compiler
from ipuxl.device.retarget import device_arguments, for_device, portable_attention
from ipuxl.kernels.attention import attention_backward, attention_forward

from .rewrites._training import train_like_eager


def _attention_step(q, k, v):
    """A causal attention over positions from ``arange`` (made on the inputs' device), and
    its input gradients: the CPU trace records ``device=cpu`` and the CPU's fused kernels."""
    position = torch.arange(q.shape[-2], device=q.device, dtype=q.dtype)
    out = F.scaled_dot_product_attention(q + position[:, None], k, v, is_causal=True)
    return (out, *torch.autograd.grad((out * out).sum(), (q, k, v)))


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 5, 3, 4, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3)]


def _targets(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_a_cpu_trace_run_elsewhere_names_that_device_and_portable_attention():
    gm = make_fx(_attention_step)(*_inputs())
    targets = _targets(gm.graph)
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in targets
    assert any(n.kwargs.get("device") == torch.device("cpu") for n in gm.graph.nodes)
    assert for_device(gm.graph, torch.device("meta")).modified
    targets = _targets(gm.graph)
    assert attention_forward in targets and attention_backward in targets
    assert not any("_for_cpu" in str(t) for t in targets)
    devices = [n.kwargs["device"] for n in gm.graph.nodes if "device" in n.kwargs]
    assert devices and all(d == torch.device("meta") for d in devices)


def test_a_cpu_program_is_left_as_traced():
    gm = make_fx(_attention_step)(*_inputs())
    before = gm.code
    assert not for_device(gm.graph, torch.device("cpu")).modified
    gm.recompile()
    assert gm.code == before


def test_portable_attention_computes_what_eager_computes():
    inputs = _inputs(torch.float64)  # the kernels sum in another order: float32 differs in the last bits
    gm = make_fx(_attention_step)(*inputs)
    assert portable_attention(gm.graph).modified
    gm.recompile()
    for got, want in zip(gm(*inputs), _attention_step(*inputs)):
        assert_close(got, want)


class _Classifier(nn.Module):
    """A small Hugging Face BERT returning its loss (padding masks: the attention mask path)."""

    def __init__(self):
        super().__init__()
        config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = transformers.BertForSequenceClassification(config)

    def forward(self, ids, mask, labels):
        return self.bert(input_ids=ids, attention_mask=mask, labels=labels).loss


def test_a_transformer_trains_as_eager_with_portable_attention(monkeypatch):
    """The whole training program with the portable attention (as on CUDA), run on the CPU.
    SGD, not AdamW: a key's bias has a zero true gradient (it shifts a query's scores alike),
    so Adam's normalised steps of it follow each kernel's rounding noise."""
    monkeypatch.setattr(ipuxl.device.compiler, "for_device",  # on any device, the CPU too
                        lambda graph, device: (device_arguments(graph, device), portable_attention(graph))[1])
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (12, 8), generator=gen)
    mask = torch.ones(12, 8, dtype=torch.long)
    mask[::2, 6:] = 0
    labels = torch.randint(0, 3, (12,), generator=gen)
    code = train_like_eager(_Classifier(), ids, mask, labels, lr=0.1, optimizer=torch.optim.SGD)
    assert "attention_forward" in code and "attention_backward" in code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_transformer_traced_on_the_host_trains_on_cuda_as_eager_cuda():
    """The end-to-end check of this module on a GPU: positions made on the CPU in the trace
    and the CPU's fused attention, run on CUDA, give eager CUDA's weights."""
    torch.manual_seed(0)
    model = _Classifier()
    eager = copy.deepcopy(model).cuda()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (12, 8), generator=gen)
    mask = torch.ones(12, 8, dtype=torch.long)
    mask[::2, 6:] = 0
    labels = torch.randint(0, 3, (12,), generator=gen)
    ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(3),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for call in range(2):
        rows = slice(call * 6, (call + 1) * 6)
        ipu(ids[rows], mask[rows], labels[rows])
        for step in range(3):
            part = slice(call * 6 + 2 * step, call * 6 + 2 * step + 2)
            opt.zero_grad()
            eager(ids[part].cuda(), mask[part].cuda(), labels[part].cuda()).backward()
            opt.step()
    ipu.copyWeightsToHost()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
