"""Graphcore's PopXL applications (BERT, GPT-J) run on ipuxl, with their own tests.

``../shared/reference/apps`` (README there) holds the applications as Graphcore wrote
them. Each app's tests run as upstream runs them, ``python -m ipuxl.compat -m pytest
tests`` from the app folder (here a copy of it: some tests write into their folder),
with the reference's shim (``PY310_DATACLASS`` for Python 3.11, ``python3`` running
programs through ``ipuxl.compat``). Every test must pass but the documented exclusions:

- test files that import ``popart._internal`` (PopART's C++ IR; no reimplementation can
  have it): they must fail to import with ipuxl's error naming it;
- tests that download models or data (GPT-J's ``test_overfitting``: a Hugging Face
  tokenizer and the GLUE data set).

Beyond the apps' execution tests (which check that a run finishes), two checks train
the apps' own programs on fixed data and require the loss to fall: GPT-J fine-tuning
with tensor parallelism 2 x data parallelism 2 (RTS, phased execution), and BERT SQuAD
training with data parallelism 2.

The applications need packages ipuxl does not (``APP_PACKAGES``) and a Hugging Face
``transformers`` whose layers they were written against (4.18 to 4.25; later releases
changed the signatures the tests call). They run in the interpreter ``IPUXL_APPS_PYTHON``
names, by default a venv of the clone's own made on first use (``_apps_python``); the
tests skip, saying why, when it lacks them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests._venv_lock import venv_lock

ROOT = Path(__file__).resolve().parents[2]
APPS = Path(os.environ.get("IPUXL_APPS_DIR", ROOT.parent / "shared" / "reference" / "apps"))
REQUIREMENTS = Path(__file__).with_name("requirements.txt")


def _apps_python() -> str:
    """The applications' interpreter: ``IPUXL_APPS_PYTHON`` when set; else ``.venv-apps`` in
    the clone, made once (a venv over this interpreter's packages, with the applications'
    own from ``requirements.txt``: they pin a transformers release older than ipuxl's
    tests use); this interpreter when that cannot be made (offline: the tests then skip,
    saying what is missing)."""
    explicit = os.environ.get("IPUXL_APPS_PYTHON")
    if explicit:
        return explicit
    venv = ROOT / ".venv-apps"
    python, ready = venv / "bin" / "python", venv / "requirements.txt"
    with venv_lock(venv):  # another xdist worker may be making it: wait for it, then use it
        if ready.exists() and ready.read_text() == REQUIREMENTS.read_text():
            return str(python)
        try:
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True,
                           capture_output=True, timeout=600)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)], check=True,
                           capture_output=True, timeout=1800)
        except (OSError, subprocess.SubprocessError):
            return sys.executable
        ready.write_text(REQUIREMENTS.read_text())
    return str(python)


APPS_PY = _apps_python()

#: import name -> what the apps use it for
APP_PACKAGES = {"transformers": "the Hugging Face layers the tests compare with", "yaml": "the configs",
                "scipy": "examples-utils", "more_itertools": "examples-utils",
                "simple_parsing": "the command lines", "psutil": "examples-utils",
                "filelock": "examples-utils", "wandb": "imported by every training script"}
TRANSFORMERS = ((4, 18), (4, 26))  # [from, to): the releases the apps' tests were written for

#: test files that cannot run anywhere but on PopART: they import its C++ IR
POPART_INTERNAL = {
    "bert_popxl": ["tests/unit/layer/test_attention_graph.py", "tests/unit/layer/test_embedding_graph.py",
                   "tests/unit/layer/test_feed_forward_graph.py", "tests/unit/layer/test_squad_graph.py"],
    "gpt_j_popxl": [],
}
#: tests that download a model or a data set
DOWNLOADS = {"bert_popxl": [], "gpt_j_popxl": ["tests/integration/execution/test_overfitting.py"]}
#: at least this many tests must pass (the apps' test counts when this was written)
MIN_PASSED = {"bert_popxl": 12, "gpt_j_popxl": 14}


def _environment_problem() -> str | None:
    """Why the apps cannot run here, or None."""
    if not (APPS / "README.md").exists():
        return f"the applications are not at {APPS} (set IPUXL_APPS_DIR)"
    code = ("import importlib, json, sys\nmissing = []\n"
            f"for name in {sorted(APP_PACKAGES)!r}:\n"
            "    try: importlib.import_module(name)\n"
            "    except ImportError: missing.append(name)\n"
            "version = None\n"
            "if 'transformers' not in missing:\n"
            "    import transformers; version = transformers.__version__\n"
            "print(json.dumps({'missing': missing, 'transformers': version}))\n")
    try:
        found = json.loads(subprocess.run([APPS_PY, "-c", code], capture_output=True, text=True, timeout=300,
                                          check=True).stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        return f"cannot run IPUXL_APPS_PYTHON={APPS_PY}: {error}"
    if found["missing"]:
        needs = "; ".join(f"{m} ({APP_PACKAGES[m]})" for m in found["missing"])
        return f"{APPS_PY} lacks the applications' packages: {needs}"
    version = tuple(int(p) for p in found["transformers"].split(".")[:2])
    if not TRANSFORMERS[0] <= version < TRANSFORMERS[1]:
        return (f"transformers {found['transformers']} in {APPS_PY}: the applications' tests call the Hugging Face "
                "layers of transformers 4.18-4.25 (later releases changed their signatures); set IPUXL_APPS_PYTHON "
                "to a Python with transformers==4.25.1")
    return None


PROBLEM = _environment_problem()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")]


def _app_copy(app: str, tmp_path: Path) -> Path:
    """A writable copy of the app beside links to the reference's deps and shim."""
    shutil.copytree(APPS / app, tmp_path / app, ignore=shutil.ignore_patterns("__pycache__"))
    for shared in ("deps", "shim"):
        (tmp_path / shared).symlink_to(APPS / shared)
    for path in (tmp_path / app).rglob("*"):
        path.chmod(path.stat().st_mode | 0o200)
    return tmp_path / app


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT", "PYTEST_CURRENT_TEST")}
    env.update({"APPS_PY": APPS_PY, "PY310_DATACLASS": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2"),
                "PATH": os.pathsep.join([str(APPS / "shim" / "bin"), env.get("PATH", "")]),
                "PYTHONPATH": os.pathsep.join([str(ROOT), ".", "../deps", "../shim/site"])})
    return env


def _run(app_dir: Path, args: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([APPS_PY, "-m", "ipuxl.compat", *args], cwd=app_dir, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _results(junit: Path) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, message)}`` from pytest's JUnit XML: passed, failed, error, skipped."""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = (found.get("message") or "") + (found.text or "")
                break
        results[name] = (outcome, message)
    return results


@pytest.mark.parametrize("app", ["bert_popxl", "gpt_j_popxl"])
def test_the_apps_own_tests_pass(app, tmp_path):
    app_dir = _app_copy(app, tmp_path)
    junit = tmp_path / "junit.xml"
    ignored = [f"--ignore={path}" for path in DOWNLOADS[app]]
    proc = _run(app_dir, ["-m", "pytest", "tests", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                          f"--junitxml={junit}", *ignored], timeout=1800)
    assert junit.exists(), proc.stdout[-5000:] + proc.stderr[-5000:]
    results = _results(junit)
    excluded = {path: message for name, (outcome, message) in results.items()
                if outcome == "error" and (path := next((p for p in POPART_INTERNAL[app]
                                                         if p.replace("/", ".")[:-3] in name), None))}
    assert sorted(excluded) == sorted(POPART_INTERNAL[app]), proc.stdout[-5000:]
    for path, message in excluded.items():
        assert "popart._internal" in message and "C++ IR" in message, (path, message)
    others = {name: result for name, result in results.items()
              if not any(p.replace("/", ".")[:-3] in name for p in POPART_INTERNAL[app])}
    not_passed = {name: (outcome, message[-2000:]) for name, (outcome, message) in others.items()
                  if outcome != "passed"}
    assert not not_passed, json.dumps(not_passed, indent=1)[-10000:]
    assert len(others) >= MIN_PASSED[app], sorted(others)


GPTJ_TRAINING = '''
import json, sys
import numpy as np
from config import CONFIG_DIR
from finetuning import finetuning
from modelling.embedding import GPTJEmbeddingsTP
from modelling.gptj_lm import GPTJLMHeadLossAndGradTP
from utils.setup import gptj_config_setup
from utils.utils import tensor_parallel_input

config, *_ = gptj_config_setup(CONFIG_DIR / "finetuning.yml", "release", "tiny", wandb_setup=False,
                               hf_model_setup=False)
session = finetuning(config, no_init=False)
tp, dp = config.execution.tensor_parallel, config.execution.data_parallel
steps = session.ir.num_host_transfers
rng = np.random.default_rng(0)
words = rng.integers(0, config.model.embedding.vocab_size,
                     (steps * dp, config.execution.micro_batch_size * config.model.sequence_length))
labels = np.roll(words, -1, axis=1)

def per_replica(data, offset):
    return tensor_parallel_input(data, tp, tp * dp, lambda d, i: offset(d, i, config)).reshape(
        steps, tp * dp, -1).astype(np.int32)

inputs = {session.inputs.words: per_replica(words, GPTJEmbeddingsTP.offset_input),
          session.inputs.labels: per_replica(labels, GPTJLMHeadLossAndGradTP.offset_input),
          session.inputs.lr: np.full((steps, tp * dp), 1e-3, np.float32)}
with session:
    losses = [float(np.mean(session.run(inputs)[session.outputs.loss])) for _ in range(6)]
print("LOSSES " + json.dumps(losses))
'''

BERT_TRAINING = '''
import json
import numpy as np
from config import CONFIG_DIR
from squad_training import squad_training_phased
from utils.setup import bert_config_setup

config, _ = bert_config_setup(CONFIG_DIR / "squad_training.yml", "phased", "large")
session = squad_training_phased(config)
steps, dp = session.ir.num_host_transfers, config.execution.data_parallel
mb, seq = config.execution.micro_batch_size, config.model.sequence_length
rng = np.random.default_rng(0)
inputs = {session.inputs.words: rng.integers(0, config.model.embedding.vocab_size, (steps, dp, mb * seq)),
          session.inputs.token_type: rng.integers(0, 2, (steps, dp, mb * seq)),
          session.inputs.mask: np.ones((steps, dp, mb * seq)),
          session.inputs.labels: rng.integers(0, seq, (steps, dp, mb, 2)),
          session.inputs.lr: np.full((steps, dp), 1e-3)}
inputs = {s: v.astype(s.dtype.as_numpy()) for s, v in inputs.items()}
with session:
    losses = [float(np.mean(session.run(inputs)[session.outputs.loss])) for _ in range(6)]
print("LOSSES " + json.dumps(losses))
'''

TRAINING = {
    "gpt_j_popxl": (GPTJ_TRAINING, ["--layers", "2", "--global_batch_size", "8", "--micro_batch_size", "2",
                                    "--data_parallel", "2", "--tensor_parallel", "2", "--vocab_size", "128",
                                    "--sequence_length", "8", "--rotary_dim", "16", "--hidden_size", "64",
                                    "--heads", "4", "--dropout_prob", "0"]),
    "bert_popxl": (BERT_TRAINING, ["--layers", "2", "--micro_batch_size", "2", "--data_parallel", "2",
                                   "--vocab_size", "128", "--sequence_length", "8", "--max_positional_length", "8",
                                   "--hidden_size", "64", "--heads", "4", "--global_batch_size", "8",
                                   "--dropout_prob", "0"]),
}


@pytest.mark.parametrize("app", ["gpt_j_popxl", "bert_popxl"])
def test_the_apps_training_programs_learn(app, tmp_path):
    """The apps' own training programs (GPT-J: TP 2 x DP 2 with RTS; BERT SQuAD: DP 2), tiny,
    trained on one fixed batch: the loss falls."""
    app_dir = _app_copy(app, tmp_path)
    script, args = TRAINING[app]
    (app_dir / "learn_check.py").write_text(script)
    proc = _run(app_dir, ["learn_check.py", *args], timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    losses = json.loads(proc.stdout.split("LOSSES ")[-1])
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses
