"""``benchmarks/bench_bert_layer.py`` (Graphcore's BERT PopXL application's encoder layer,
imported through ``ipuxl.compat``, trained on ipuxl against Hugging Face's ``BertLayer`` in
eager PyTorch) runs in its quick mode and its value check passes."""
from __future__ import annotations

import importlib.util
import re

import pytest

from tests.benchmarks._run import ROOT, run_script

pytest.importorskip("transformers")
APPS = ROOT.parent / "shared" / "reference" / "apps"
# what the application's config imports (its examples_utils), from tests/apps/requirements.txt
APP_MODULES = ("cppimport", "simple_parsing", "more_itertools")
MISSING = [m for m in APP_MODULES if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(not (APPS / "bert_popxl").is_dir(), reason="Graphcore's BERT application is not in ../shared")
@pytest.mark.skipif(bool(MISSING), reason=f"the BERT application imports {', '.join(MISSING)}, not installed here "
                                          "(pip install -r tests/apps/requirements.txt)")
def test_the_applications_layer_trains_like_hugging_faces_layer():
    out = run_script("bench_bert_layer.py", "--quick", "--check-steps", "2", "--threads", "1",
                     "--apps", str(APPS))
    assert re.search(r"after 2 steps: weight updates within \S+ of eager's .*last input gradient equal", out), out
    assert re.search(r"^\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+$", out, re.MULTILINE), out  # the timing row
