"""Hugging Face optimum-graphcore 0.7.1 (transformers 4.29.2) fine-tunes on ipuxl's IPUs.

``IPUTrainer`` + ``IPUConfig`` train a tiny BERT, GPT-2 and ViT built from configs,
pipelined over two IPUs as ``ipu_config.layers_per_ipu`` says (optimum's pipelined
model classes, ``poptorch.BeginBlock``, ``PipelinedExecution``), in the optimum venv
(``_client_venv``). The oracle is the same fine-tuning in eager PyTorch, in the same
venv (``optimum_programs.py --eager``: the plain ``transformers`` model, optimum's
AdamW without bias correction and linear learning-rate decay): every weight must match.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from tests.poptorch_compat.clients._client_venv import client_python, run_client

PYTHON, PROBLEM = client_python("optimum")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")]
PROGRAMS = Path(__file__).with_name("optimum_programs.py")


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"{'-'.join(args).replace(',', '_')}.pt"
    run_client(PYTHON, PROGRAMS, args[0], str(out), *args[1:])
    return torch.load(out)


@pytest.mark.parametrize("model, pipelined", [("bert", "PipelinedBertForSequenceClassification"),
                                              ("gpt2", "PipelinedGPT2LMHeadModel"),
                                              ("vit", "PipelinedViTForImageClassification")])
def test_iputrainer_pipelined_over_two_ipus_matches_eager_fine_tuning(tmp_path, model, pipelined):
    ipu = _run(tmp_path, model, "--layers-per-ipu", "1,1")
    eager = _run(tmp_path, model, "--eager")
    assert ipu["model_class"] == pipelined
    assert_close(ipu["before"], eager["before"], rtol=0, atol=0)  # the same initial model
    moved = max((eager["after"][k] - eager["before"][k]).abs().max().item() for k in eager["after"])
    assert moved > 1e-3  # three optimizer steps changed the weights
    # float32 on both sides; the device sums 16 micro-batch gradients in another order than eager's backward
    assert_close(ipu["after"], eager["after"], rtol=1e-4, atol=2e-5)
    assert len(ipu["losses"]) == 3 and all(torch.isfinite(torch.tensor(ipu["losses"])))
