"""``benchmarks/bench_transformers.py`` (Hugging Face BERT, GPT-2, T5 and ViT trained with
AdamW through ``trainingModel`` against eager PyTorch and torch.compile) runs to the end
at toy sizes, and ipuxl's weights pass its check against eager float64 for every model.
torch.compile's side is left out here (its first compile takes minutes a model)."""
from __future__ import annotations

import re

import pytest

from tests.benchmarks._run import run_script

pytest.importorskip("transformers")


def test_every_model_trains_and_passes_the_weight_check_at_toy_sizes():
    out = run_script("bench_transformers.py", "--tiny", "--quick", "--no-compile", "--threads", "1")
    rows = dict(re.findall(r"^(bert|gpt2|t5|vit) .* (ok|MISMATCH.*)$", out, re.MULTILINE))
    assert rows == {"bert": "ok", "gpt2": "ok", "t5": "ok", "vit": "ok"}, out
    assert "weight check: 4 ok, 0 mismatch" in out and "failed to run" not in out, out
    assert re.search(r"geometric mean eager/ipuxl \d+\.\d+", out), out


def test_the_profile_script_profiles_both_sides_at_toy_sizes():
    out = run_script("profile_transformer.py", "--tiny", "--model", "gpt2", "--calls", "1", "--top", "3")
    for side in ("ipuxl", "eager"):
        assert re.search(rf"^== gpt2 {side}: \d+\.\d ms per call \(profiled\); host waits per call: "
                         r"cudaStreamSynchronize 0, cudaDeviceSynchronize 0, cudaMemcpy 0$", out, re.MULTILINE), out
    assert out.count("Self CPU time total") == 2, out
