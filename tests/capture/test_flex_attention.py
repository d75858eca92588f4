"""``flex_attention`` (torch.nn.attention), written for torch.compile, in captured modules: its
dense math gives eager's outputs, and trains (eager torch has no CPU backward for it) with the
gradients of the same attention written with ``scaled_dot_product_attention``, including a
learnt bias that its ``score_mod`` captures. Hugging Face's ``flex_attention`` implementation
trains a Llama as its ``sdpa`` one does; its padding check is named with what to use."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import TraceError
from tests.capture._eager import train_like_eager

HEADS, SEQ, DIM = 2, 8, 4
_TORCHS_OP = flex_module.flex_attention_hop


def _causal(b, h, q, kv):
    return q >= kv


class Attention(nn.Module):
    """Self-attention over ``x`` (batch, SEQ, HEADS * DIM): causal, with a learnt per-head
    slope times the query-key distance (ALiBi-like) added to the scores; by flex attention, or
    by SDPA with the same bias and mask as a tensor (the oracle)."""

    def __init__(self, flex: bool):
        super().__init__()
        self.qkv = nn.Linear(HEADS * DIM, 3 * HEADS * DIM)
        self.slopes = nn.Parameter(torch.tensor([-0.5, -0.25]))
        self.head = nn.Linear(HEADS * DIM, 3)
        self.flex = flex

    def forward(self, x, y):
        batch = x.shape[0]
        q, k, v = self.qkv(x).view(batch, SEQ, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
        if self.flex:
            slopes = self.slopes
            mask = create_block_mask(_causal, None, None, SEQ, SEQ, device="cpu")
            out = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + slopes[h] * (i - j), block_mask=mask)
        else:
            distance = (torch.arange(SEQ)[:, None] - torch.arange(SEQ)[None, :]).float()
            bias = self.slopes[:, None, None] * distance
            bias = bias.masked_fill(~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        logits = self.head(out.transpose(1, 2).reshape(batch, SEQ, HEADS * DIM)).mean(1)
        return logits, F.cross_entropy(logits, y)


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, SEQ, HEADS * DIM, generator=gen), torch.tensor([0, 2, 1])


def test_inference_gives_eagers_outputs():
    torch.manual_seed(0)
    model = Attention(flex=True).eval()
    x, y = _batch()
    with torch.no_grad():
        eager_logits, eager_loss = model(x, y)
    logits, loss = poptorch.inferenceModel(model)(x, y)
    torch.testing.assert_close(logits, eager_logits)
    torch.testing.assert_close(loss, eager_loss)
    assert flex_module.flex_attention_hop is _TORCHS_OP  # the capture's patch is undone


def test_training_gives_the_gradients_of_the_same_attention_by_sdpa():
    torch.manual_seed(0)
    model = Attention(flex=True)

    def by_sdpa(flex_model):
        oracle = copy.deepcopy(flex_model)
        oracle.flex = False
        return oracle

    train_like_eager(model, _batch(), lr=0.1, oracle=by_sdpa)
    assert not torch.equal(model.slopes.detach(), torch.tensor([-0.5, -0.25]))  # the captured bias trained


transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100,
             num_key_value_heads=2, max_position_embeddings=32)


def _llama_batch():
    gen = torch.Generator().manual_seed(1)
    return dict(input_ids=torch.randint(3, 100, (2, 16), generator=gen),
                labels=torch.randint(3, 100, (2, 16), generator=gen))


def test_hugging_faces_flex_attention_trains_as_its_sdpa():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="flex_attention"))
    oracle = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="sdpa"))
    oracle.load_state_dict(model.state_dict())
    train_like_eager(model, _llama_batch(), lr=1e-2, loss_of=lambda out: out.loss, oracle=lambda _: oracle)


def test_hugging_faces_flex_padding_check_is_named_with_what_to_use():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="flex_attention"))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, 12:] = 0
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))
    with pytest.raises(TraceError, match="tensor values are not known") as info:
        ipu(**_llama_batch(), attention_mask=mask)
    assert "attn_implementation='sdpa'" in info.value.fix
