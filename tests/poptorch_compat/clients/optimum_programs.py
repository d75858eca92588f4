"""Hugging Face optimum-graphcore programs on IPUs, run by ``test_optimum_graphcore.py`` in the optimum venv.

``python optimum_programs.py MODEL OUT --layers-per-ipu 1,1`` fine-tunes a tiny
``transformers`` model built from a config (no download: BERT for sequence
classification, GPT-2 language modelling, ViT image classification) with optimum's
``IPUTrainer`` and ``IPUConfig``, pipelined over the IPUs ``layers_per_ipu`` names, in
float32 (``fp32=True``), and saves the weights before and after and the loss of each
step. ``--eager`` instead trains the plain ``transformers`` model in eager PyTorch as
``IPUTrainer`` does (the test's oracle): every step a mean over the micro-batches'
losses, optimum's AdamW without bias correction, optimum's linear learning-rate decay.
Each optimizer step takes the whole data set (batch 2 x gradient accumulation 16 = 32
rows), so the order optimum's sampler draws the rows in does not matter. The venv has
``python -m ipuxl.compat --install``: optimum imports ``poptorch`` as on an IPU machine.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

ROWS, BATCH, ACCUMULATION, STEPS, LR = 32, 2, 16, 3, 1e-3


def build(kind: str) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """A tiny model of ``kind`` (dropout off) and its data set."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=32, num_labels=2,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForSequenceClassification(config)
        ids = torch.randint(1, 64, (ROWS, 12), generator=g)
        rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "token_type_ids": torch.zeros_like(i),
                 "labels": (i[0] > 32).long()} for i in ids]
    elif kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, 64, (ROWS, 12), generator=g)
        rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]
    else:
        config = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.ViTForImageClassification(config)
        x = torch.randn(ROWS, 3, 16, 16, generator=g)
        rows = [{"pixel_values": x[i], "labels": torch.tensor(i % 3)} for i in range(ROWS)]
    return model, rows


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def train_ipu(kind: str, layers: list[int]) -> dict:
    from optimum.graphcore import IPUConfig, IPUTrainer, IPUTrainingArguments

    model, rows = build(kind)
    before = state(model)
    ipu_config = IPUConfig(layers_per_ipu=layers, ipus_per_replica=len(layers), embedding_serialization_factor=1)
    args = IPUTrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH,
                                gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=LR,
                                logging_steps=1, report_to=[], dataloader_drop_last=True, save_strategy="no",
                                seed=0, fp32=True)
    trainer = IPUTrainer(model=model, ipu_config=ipu_config, args=args, train_dataset=rows)
    trainer.train()
    trained = trainer.model  # optimum's pipelined copy of the model, its weights the device's
    after = {k.replace("_orig_mod.", ""): v for k, v in state(trained).items()}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"before": before, "after": after, "losses": losses, "model_class": type(trained).__name__}


def train_eager(kind: str) -> dict:
    """What IPUTrainer does, in eager PyTorch (see the module docstring)."""
    model, rows = build(kind)
    before = state(model)
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    params = [p for p in model.parameters() if p.requires_grad]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    losses = []
    for step in range(STEPS):
        lr = LR * (1 - step / STEPS)  # transformers' linear schedule, no warm-up
        model.zero_grad()
        total = 0.0
        for s in range(0, ROWS, BATCH):  # the mean of the micro-batches' losses
            loss = model(**{k: t[s:s + BATCH] for k, t in batch.items()}).loss / (ROWS // BATCH)
            loss.backward()
            total += float(loss)
        with torch.no_grad():  # poptorch.optim.AdamW(bias_correction=False), weight decay 0
            for p, mi, vi in zip(params, m, v):
                mi.mul_(0.9).add_(p.grad, alpha=0.1)
                vi.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                p.sub_(lr * mi / (vi.sqrt() + 1e-8))
        losses.append(total)
    return {"before": before, "after": state(model), "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=["bert", "gpt2", "vit"])
    parser.add_argument("out")
    parser.add_argument("--layers-per-ipu", default="2")
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    layers = [int(n) for n in args.layers_per_ipu.split(",")]
    torch.save(train_eager(args.model) if args.eager else train_ipu(args.model, layers), args.out)


if __name__ == "__main__":
    main()
