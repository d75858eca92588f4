"""Library code written for torch.compile / torch.export captures and trains as eager does.

Hugging Face models (BERT, GPT-2, T5, ViT, Llama, BLOOM) built from configs (nothing is
downloaded) and ``nn.Transformer`` train through ``trainingModel`` with AdamW, with and
without attention masks; weights after several steps must equal eager PyTorch's.
"""
from __future__ import annotations

import copy

import pytest
import torch

import ipuxl.poptorch_compat as poptorch
from ipuxl.errors import TraceError
from tests.capture._eager import train_like_eager

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")

STEPS = 3
# An attention key's bias has no effect on softmax (it adds the same value to every score of
# a query), so its true gradient is zero: what autograd returns is rounding noise, which
# Adam scales up to a full step. Its trajectory is noise in eager too; it is not compared.
_ZERO_GRADIENT = ("key.bias", "k_proj.bias", "attention.key.bias")
# Float64: Adam divides each gradient by its own running size, so a gradient element near zero
# turns float32 rounding noise (sums in another order) into a step of the learning rate's size;
# in float64 that noise is far below every real gradient here. What remains: the optimiser's
# hyperparameters are float32 tensors on the device (as PopTorch's), so the updates differ from
# eager's Python-double ones at about 1e-7 relative, and Hugging Face's LM losses upcast logits
# with .float() (float32) in both runs. Adam turns such a difference in a gradient element near
# zero into up to ~1e-6 of weight; a wrong gradient or update would be of the step's size, 1e-3.
TOL = dict(rtol=1e-6, atol=1e-6)


def _train_like_eager(model: torch.nn.Module, batch: dict, loss_of=lambda out: out.loss) -> None:
    """``STEPS`` AdamW steps through ``trainingModel`` and eagerly, in float64; losses and weights must match."""
    torch.manual_seed(0)
    model = model.double()
    batch = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}
    ref = copy.deepcopy(model)
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(STEPS):
        out = ipu(**batch)
        ref_opt.zero_grad()
        ref_loss = loss_of(ref(**batch))
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss_of(out), ref_loss.detach(), **TOL)
    ipu.copyWeightsToHost()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if any(name.endswith(k) for k in _ZERO_GRADIENT):
            continue
        torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=lambda m: f"{name}: {m}")


def _ids(vocab: int = 100, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _padding_mask(batch: int = 2, seq: int = 12) -> torch.Tensor:
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 4:] = 0  # the first sequence is padded: masks change the result
    return mask


SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_bert_sequence_classification(masked: bool):
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**SMALL, hidden_dropout_prob=0.0,
                                                                               attention_probs_dropout_prob=0.0))
    batch = dict(input_ids=_ids(), labels=torch.tensor([0, 1]))
    if masked:
        batch["attention_mask"] = _padding_mask()
    _train_like_eager(model, batch)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_gpt2_causal_lm(masked: bool):
    """GPT-2 returns its key/value cache (an object holding tensors) beside the loss."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _ids()
    batch = dict(input_ids=ids, labels=ids)
    if masked:
        batch["attention_mask"] = _padding_mask()
    _train_like_eager(transformers.GPT2LMHeadModel(config), batch)


def test_t5_encoder_decoder():
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=100,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    ids = _ids()
    _train_like_eager(transformers.T5ForConditionalGeneration(config),
                      dict(input_ids=ids, attention_mask=_padding_mask(), labels=ids))


def test_vit_image_classification():
    torch.manual_seed(0)
    config = transformers.ViTConfig(**{k: v for k, v in SMALL.items() if k != "vocab_size"}, image_size=16,
                                    patch_size=4, num_labels=5, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    batch = dict(pixel_values=torch.randn(2, 3, 16, 16), labels=torch.tensor([1, 4]))
    _train_like_eager(transformers.ViTForImageClassification(config), batch)


def test_bloom_causal_lm_with_its_own_autograd_function():
    """BLOOM's MLP applies GeLUFunction (an old-style autograd.Function) while training: its own
    backward gives the gradient, as eagerly (``capture.custom_functions``)."""
    config = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=100, hidden_dropout=0.0,
                                      attention_dropout=0.0)
    _train_like_eager(transformers.BloomForCausalLM(config),
                      dict(input_ids=_ids(), attention_mask=_padding_mask(), labels=_ids()))


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_llama_style_causal_lm(masked: bool):
    """RoPE, RMSNorm, grouped-query attention through scaled_dot_product_attention."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=32)
    ids = _ids()
    batch = dict(input_ids=ids, labels=ids)
    if masked:
        batch["attention_mask"] = _padding_mask()
    _train_like_eager(transformers.LlamaForCausalLM(config), batch)


def _moe(arch: str):
    torch.manual_seed(0)
    common = dict(SMALL, num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2)
    if arch == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4))
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **common, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_mixture_of_experts_trains_through_its_custom_op(arch: str):
    """While compiling (so while ipuxl captures), Hugging Face's grouped-mm experts call
    ``transformers::grouped_mm_fallback``, a ``torch.library.custom_op`` whose gradient is its
    registered formula (``kernels.custom_ops``); eagerly they run F.grouped_mm, which has no
    float64 kernel: SGD in float32, whose updates are exact, keeps the comparison tight."""
    model = _moe(arch)
    assert model.config._experts_implementation == "grouped_mm"
    train_like_eager(model, dict(input_ids=_ids(), attention_mask=_padding_mask(), labels=_ids()), steps=STEPS,
                     lr=1e-2, loss_of=lambda out: out.loss)


def test_eager_experts_are_refused_with_the_implementation_to_use():
    model = _moe("mixtral")
    model.set_experts_implementation("eager")
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))
    with pytest.raises(TraceError, match="tensor values") as info:
        ipu(input_ids=_ids(), labels=_ids())
    assert "set_experts_implementation('grouped_mm')" in info.value.fix


class _Seq2Seq(torch.nn.Module):
    """``nn.Transformer`` with the causal mask it builds itself and an optional padding mask."""

    def __init__(self):
        super().__init__()
        self.t = torch.nn.Transformer(d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                                      dim_feedforward=32, dropout=0.0, batch_first=True)

    def forward(self, src, tgt, src_key_padding_mask=None):
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        out = self.t(src, tgt, tgt_mask=causal, src_key_padding_mask=src_key_padding_mask)
        return out, out.pow(2).mean()


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_nn_transformer(masked: bool):
    torch.manual_seed(0)
    batch = dict(src=torch.randn(2, 6, 16), tgt=torch.randn(2, 5, 16))
    if masked:
        batch["src_key_padding_mask"] = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    _train_like_eager(_Seq2Seq(), batch, loss_of=lambda out: out[1])


def test_is_compiling_answers_true_only_while_capturing():
    seen = []

    class Asks(torch.nn.Module):
        def forward(self, x):
            seen.append((torch.compiler.is_compiling(), torch.compiler.is_exporting()))
            return x * 2

    poptorch.inferenceModel(Asks())(torch.ones(2))
    assert seen and all(answer == (True, True) for answer in seen)
    assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()


class _Branchy(torch.nn.Module):
    """A decision on a tensor computed from constants, and one on the input's values."""

    def forward(self, x):
        table = torch.arange(4) * 2
        scale = 3.0 if bool((table == torch.tensor([0, 2, 4, 6])).all()) else -1.0  # known: constants only
        return x * scale


def test_a_decision_on_constant_values_is_taken_as_eager_takes_it():
    model = _Branchy()
    x = torch.randn(3)
    torch.testing.assert_close(poptorch.inferenceModel(model)(x), model(x))


@pytest.mark.parametrize("read", ["bool", "tolist"])
def test_a_decision_on_input_values_is_refused_with_the_fix(read):
    """``bool(x.sum() > 0)``, and ``tolist()`` as JetMoE's router calls it (sizes of the
    experts' token groups)."""
    class OnInput(torch.nn.Module):
        def forward(self, x):
            if read == "tolist":
                return x.split((x > 0).long().sum(0).tolist())[0]
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(TraceError, match="tensor values are not known while capturing") as info:
        poptorch.inferenceModel(OnInput())(torch.ones(3, 2))
    assert "torch.where" in info.value.fix


def test_a_causal_mask_from_the_host_captures_and_trains_as_eagerly():
    """nn.Transformer compares a mask it is given with a causal one (a read of its values) to
    choose a faster path; a mask that comes in as an input has no values at capture, and the
    check then answers False (torch: only a speed hint): the mask is applied as given, the
    model captures and trains as eagerly, with or without tgt_is_causal."""
    class Decoder(torch.nn.Module):
        def __init__(self, **kw):
            super().__init__()
            self.t = torch.nn.Transformer(d_model=16, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                                          dim_feedforward=32, dropout=0.0, batch_first=True)
            self.kw = kw

        def forward(self, src, tgt, tgt_mask):
            out = self.t(src, tgt, tgt_mask=tgt_mask, **self.kw)
            return out, out.pow(2).mean()

    batch = dict(src=torch.randn(2, 6, 16), tgt=torch.randn(2, 5, 16),
                 tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(5))
    _train_like_eager(Decoder(), batch, loss_of=lambda out: out[1])
    _train_like_eager(Decoder(tgt_is_causal=True), batch, loss_of=lambda out: out[1])


def test_a_constant_written_from_an_input_is_no_longer_known():
    """A known tensor written in place from unknown values loses its known value: the
    decision then depends on the input, and capture refuses it instead of baking one in."""
    class Writes(torch.nn.Module):
        def forward(self, x):
            flags = torch.zeros(3)
            flags.copy_(x)
            return x * 2 if bool(flags.sum() > 0) else x

    with pytest.raises(TraceError, match="tensor values are not known"):
        poptorch.inferenceModel(Writes())(torch.ones(3))


def test_an_error_inside_an_installed_library_names_the_librarys_line():
    """Installed packages (site-packages) are the user's code for ``where``: a capture that fails
    inside one (Hugging Face's models) points at the library's line, not at nothing."""
    import os

    from ipuxl.ir.context import traceback_source_line
    from ipuxl.source import STDLIB_DIR

    library = os.path.join(STDLIB_DIR, "site-packages", "some_library", "layers.py")
    namespace: dict = {}
    exec(compile("def forward(x):\n    return x.missing\n", library, "exec"), namespace)
    with pytest.raises(AttributeError) as info:
        namespace["forward"](object())
    assert traceback_source_line(info.value.__traceback__) == f"{library}:2 in forward"


@pytest.mark.parametrize("operator", ["cond", "while_loop"])
def test_control_flow_operators_are_refused_with_what_to_use(operator: str):
    """torch.cond and torch.while_loop hand functions to Dynamo, which a capture does not run
    (flex attention, which does too, runs its dense math: test_flex_attention.py)."""

    class Uses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            if operator == "cond":
                return torch.cond(h.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (h,)).sum()
            from torch._higher_order_ops import while_loop
            return while_loop(lambda i, t: i < 3, lambda i, t: (i + 1, t * 0.5), (torch.tensor(0), h))[1].sum()

    model = Uses()
    with pytest.raises(TraceError, match=f"{operator} needs torch.compile's Dynamo") as info:
        poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(torch.randn(4, 8))
    assert "torch.where" in info.value.fix and "test_compiling.py" in info.value.where
