"""Hugging Face causal language models that nobody wrote for ipuxl train through
``trainingModel`` as eagerly: tiny configs (nothing downloaded), padding masks, SGD in float32
(exact updates), three steps; losses and every weight compared with eager PyTorch.

Dense decoders (RoPE variants, sliding windows, soft-capping, QK norms, MLA), mixtures of
experts (their grouped-mm experts call a ``torch.library.custom_op`` while compiling, which
ipuxl captures too), state-space models (Mamba's sequential scan) and a hybrid (Jamba).
Mixture-of-experts layers that loop over the experts a batch routes to (DBRX, JetMoE; no
torch.compile form either) are refused as data-dependent, with that said. PhiMoE is not here:
its router samples (Gumbel noise) in training, and ipuxl's random draws are its own.
"""
from __future__ import annotations


import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import TraceError
from tests.capture._eager import train_like_eager
from tests.capture._hf import hf_model

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")

STEPS = 3
DENSE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100,
             num_key_value_heads=2, max_position_embeddings=32)
MAMBA = dict(hidden_size=32, num_hidden_layers=2, vocab_size=100, state_size=8, expand=2, conv_kernel=4)
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1)

# name: (config class, model class, config arguments beyond DENSE (or the full set for SSMs))
ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(DENSE, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(DENSE, head_dim=8, sliding_window=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(DENSE, head_dim=8, sliding_window=8)),
    # without grouped KV heads: q_norm's outlined graph takes a transpose, whose layout it keeps
    "gemma3_mha": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(DENSE, head_dim=8, sliding_window=8,
                                                                 num_key_value_heads=4)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", DENSE),
    "cohere": ("CohereConfig", "CohereForCausalLM", DENSE),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", DENSE),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(DENSE, head_dim=8)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(DENSE, **_MLA, n_group=2, topk_group=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(DENSE, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(DENSE, head_dim=8, sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(DENSE, num_local_experts=4, num_experts_per_tok=2)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(DENSE, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      n_shared_experts=1, first_k_dense_replace=1)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(DENSE, moe_num_experts=4, moe_k=2, moe_intermediate_size=32)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(DENSE, head_dim=8, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64)),
    "mamba": ("MambaConfig", "MambaForCausalLM", MAMBA),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(MAMBA, num_heads=8, head_dim=8, n_groups=1, chunk_size=4)),
    "jamba": ("JambaConfig", "JambaForCausalLM",
              dict(DENSE, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                   expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                   mamba_dt_rank=4)),
}


def _model(config_name: str, model_name: str, arguments: dict) -> torch.nn.Module:
    return hf_model(transformers, config_name, model_name, arguments)


def _batch(masked: bool) -> dict:
    gen = torch.Generator().manual_seed(1)
    batch = dict(input_ids=torch.randint(3, 100, (2, 12), generator=gen),
                 labels=torch.randint(3, 100, (2, 12), generator=gen))
    if masked:
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[0, 8:] = 0  # the first sequence is padded
        batch["attention_mask"] = mask
    return batch


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_trains_as_eagerly(name: str):
    model = _model(*ARCHITECTURES[name])
    batch = _batch(masked=not name.startswith("mamba"))  # Mamba takes no attention mask
    train_like_eager(model, batch, steps=STEPS, lr=1e-2, loss_of=lambda out: out.loss)


@pytest.mark.parametrize("name", ["dbrx", "jetmoe"])
def test_experts_that_loop_over_routed_tokens_are_refused_as_data_dependent(name: str):
    if name == "dbrx":
        model = _model("DbrxConfig", "DbrxForCausalLM", dict(
            d_model=32, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=100,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)))
    else:
        model = _model("JetMoeConfig", "JetMoeForCausalLM",
                       dict(DENSE, num_local_experts=4, num_experts_per_tok=2, kv_channels=8))
    model(**_batch(True)).loss.backward()  # eager trains it
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))
    with pytest.raises(TraceError, match="tensor values are not known while capturing") as info:
        ipu(**_batch(True))
    assert f"models/{name}/modeling_{name}.py" in info.value.where.replace("\\", "/")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_trains_as_eagerly(reentrant: bool):
    """``gradient_checkpointing_enable()``: Hugging Face's default (non-reentrant) and the
    reentrant form older code asks for both run inline, with eager's gradients."""
    model = _model("LlamaConfig", "LlamaForCausalLM", DENSE)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    train_like_eager(model, _batch(masked=True), steps=STEPS, lr=1e-2, loss_of=lambda out: out.loss)
