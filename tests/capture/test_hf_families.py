"""Hugging Face models beyond causal language models train through ``trainingModel`` as
eagerly: encoders with a masked-LM head (factorised and shared layers, disentangled and
relative attention, Fourier mixing, pooled sequences, grouped convolutions), encoder-decoders
with a seq2seq head, and vision classifiers. Tiny configs (nothing downloaded), dropout off,
SGD in float32, two steps; losses and every weight compared with eager PyTorch.

Picked from a sweep of the masked-LM, seq2seq, classification and question-answering classes
transformers registers; each family here exercises ops the causal models of
``test_hf_architectures`` do not.
"""
from __future__ import annotations

import pytest
import torch

from tests.capture._eager import train_like_eager
from tests.capture._hf import hf_model

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")

STEPS = 2
VOCAB = 99
TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
            max_position_embeddings=64)
SEQ2SEQ = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
               decoder_start_token_id=2)
IMAGE = dict(image_size=32, num_channels=3, num_labels=3)

# name: (config class, model class, config arguments, batch kind)
FAMILIES = {
    "albert": ("AlbertConfig", "AlbertForMaskedLM", dict(TEXT, embedding_size=16), "text"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(TEXT, relative_attention=True,
                                                                  pos_att_type=["p2c", "c2p"]), "text"),
    "convbert": ("ConvBertConfig", "ConvBertForMaskedLM", dict(TEXT, embedding_size=32), "text"),
    "fnet": ("FNetConfig", "FNetForMaskedLM", dict(TEXT, num_attention_heads=None), "text"),
    "mpnet": ("MPNetConfig", "MPNetForMaskedLM", TEXT, "text"),
    "roformer": ("RoFormerConfig", "RoFormerForMaskedLM", dict(TEXT, embedding_size=32), "text"),
    "funnel": ("FunnelConfig", "FunnelForMaskedLM", dict(block_sizes=[1, 1], d_model=32, n_head=4, d_head=8,
                                                         d_inner=64, vocab_size=VOCAB), "text"),
    "squeezebert": ("SqueezeBertConfig", "SqueezeBertForMaskedLM", dict(TEXT, embedding_size=32, q_groups=2,
                                                                         k_groups=2, v_groups=2, post_attention_groups=2,
                                                                         intermediate_groups=4, output_groups=4), "text"),
    "bart": ("BartConfig", "BartForConditionalGeneration", SEQ2SEQ, "seq2seq"),
    "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration", SEQ2SEQ, "seq2seq"),
    # its decoder makes a Cache object per call and hands it to every layer; both layers dense (its
    # sparse layers loop over the tokens each expert is routed, refused as data-dependent like DBRX's)
    "nllb_moe": ("NllbMoeConfig", "NllbMoeForConditionalGeneration", dict(SEQ2SEQ, num_experts=4,
                                                                          encoder_sparse_step=4, decoder_sparse_step=4),
                 "seq2seq"),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                              vocab_size=VOCAB, decoder_start_token_id=0), "seq2seq"),
    "beit": ("BeitConfig", "BeitForImageClassification", dict(IMAGE, hidden_size=32, num_hidden_layers=2,
                                                               num_attention_heads=4, intermediate_size=64, patch_size=8,
                                                               use_relative_position_bias=True), "image"),
    "segformer": ("SegformerConfig", "SegformerForImageClassification",
                  dict(IMAGE, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                       patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2]), "image"),
    "poolformer": ("PoolFormerConfig", "PoolFormerForImageClassification",
                   dict(IMAGE, depths=[1, 1], hidden_sizes=[16, 32], num_encoder_blocks=2, patch_sizes=[7, 3],
                        strides=[4, 2], padding=[2, 1]), "image"),
}


def _model(config_name: str, model_name: str, arguments: dict) -> torch.nn.Module:
    return hf_model(transformers, config_name, model_name, arguments)


def _batch(kind: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    if kind == "image":
        return dict(pixel_values=torch.randn(2, 3, 32, 32, generator=gen), labels=torch.tensor([0, 2]))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 8:] = 0  # the first sequence is padded
    labels = torch.randint(3, VOCAB, (2, 7 if kind == "seq2seq" else 12), generator=gen)
    return dict(input_ids=torch.randint(3, VOCAB, (2, 12), generator=gen), attention_mask=mask, labels=labels)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_as_eagerly(name: str):
    config_name, model_name, arguments, kind = FAMILIES[name]
    model = _model(config_name, model_name, arguments)
    train_like_eager(model, _batch(kind), steps=STEPS, lr=1e-2, loss_of=lambda out: out.loss)
