"""Training speed and memory of Hugging Face transformers through ipuxl's ``trainingModel``
against eager PyTorch and ``torch.compile``.

Run:   python benchmarks/bench_transformers.py [--models bert,gpt2,t5,vit] [--threads T] [--device cuda]
                                               [--repeats 5] [--calls 2] [--no-memory] [--quick] [--tiny]

What it trains (``MODELS``): Hugging Face models built from their configs (nothing is
downloaded; every dropout probability 0, so the three sides compute the same function):

* ``bert``: ``BertForSequenceClassification``, BERT-base widths (hidden 768, 12 heads,
  intermediate 3072, vocabulary 30522), 4 layers, 2 labels, with a padding mask (the
  first sequence of each micro-batch ends in 32 padding tokens);
* ``gpt2``: ``GPT2LMHeadModel``, GPT-2 small widths (768, 12 heads, vocabulary 50257, tied
  input and output embeddings), 2 layers, the causal LM loss (``labels=input_ids``);
* ``t5``: ``T5ForConditionalGeneration``, the T5-small config (d_model 512, 8 heads,
  d_ff 2048, 6 encoder and 6 decoder layers, vocabulary 32128, relative position
  buckets), inputs with a padding mask, 32 target tokens;
* ``vit``: ``ViTForImageClassification``, ViT-base widths (768, 12 heads, 3072), 4 layers,
  224x224 images in 16x16 patches (197 tokens), 10 labels.

Sequences are 128 tokens; the micro-batch is 2 (``BATCH``). Each side trains with
``torch.optim.AdamW(lr=1e-4)`` (weight decay 0.01), ``ITERATIONS`` = 2 steps per call,
on the same pre-generated data (not timed):

* ipuxl: ``ipuxl.trainingModel(model, Options().deviceIterations(2), optimizer=AdamW)``:
  one call trains 2 steps on the combined batch of 4 (``Session``'s device loop);
* eager: a deep copy of the module (made before wrapping: ipuxl swaps the module
  classes) with its own AdamW (torch's default implementation on the CPU), 2 steps per
  call in a Python loop (zero_grad, forward, loss, backward, step);
* torch.compile: another deep copy, the whole step (zero_grad, forward, backward,
  optimiser step) as one ``torch.compile``'d function (inductor) with compiled autograd,
  so the backward and the AdamW update are compiled too; where that fails the model
  and the optimiser step are compiled separately (the table says which: ``step`` or
  ``model+opt``). Inductor's cache is a fresh temporary folder, so its first call
  compiles from nothing, as ipuxl's does.

The weight check (``bench_models``' approach): ipuxl, eager float32, torch.compile and
two references train ``--check-calls`` calls from one init on the same data: eager
float64 and eager float32 from weights one float32 ulp away (``one_ulp_away``). With
err(side) the largest relative L2 distance of a side's parameters and buffers from
float64 (``bench_models.relative_distance``) and err(eager32) the larger of the two
float32 eager runs', the check passes when err(ipuxl) <= max(2 * err(eager32), 1e-5).
AdamW divides each gradient by its own running size, so a weight whose true gradient is
zero (an attention key's bias: it shifts every score of a query alike) follows rounding
noise in every float32 run; the ulp-away run shows how far noise alone moves it.

First call: the wall time of each side's first call (ipuxl: capture, passes, compile and
the call itself; torch.compile: tracing, inductor's compile and the call) and its second
call (torch.compile with compiled autograd compiles the backward again there).

Timings: after one untimed warm-up timing per side, ``--repeats`` rounds in which each
side times ``--calls`` calls, the sides' order rotating by round; each side's median (ms
per call) is reported, with eager ms / ipuxl ms (> 1: ipuxl is faster) and torch.compile
ms / ipuxl ms (> 1: ipuxl is faster than torch.compile). At the end, the geometric mean
of each ratio over the models.

Peak memory (``--no-memory`` skips it): each side runs again alone in a fresh Python
process (the same imports, model, data and first call); after its first call the
process's peak resident set size is reset (``/proc/self/clear_refs``) and ``--calls``
calls run; reported is the peak RSS during those calls (``VmHWM``) minus the RSS right
after the imports, in MiB: weights, optimiser state, activations, gradients, the
compiled code's buffers and whatever the allocator keeps, as the operating system sees
it. The first call's own peak (with the compiler's memory) is not in it.

On a small or shared machine, ``--threads 1`` gives steadier numbers.

``--device cuda`` (the default where CUDA is present: ``trainingModel`` runs on ``ipu_hw``,
which is CUDA there, so ``cpu`` is refused on such a machine): every side trains on the
GPU. The data stays on the host, as a data loader gives it: eager and torch.compile copy
each step's batch to the GPU, ipuxl stages each call's (its session's host streams).
Every timing and first call ends with ``torch.cuda.synchronize()``. ipuxl replays each
call from its third on as one CUDA graph (``ipuxl.device.cuda_graphs``; the first table
says whether it did, or why not; ``IPUXL_CUDA_GRAPHS=0`` in the environment turns it off). Peak memory on CUDA is ``torch.cuda.max_memory_reserved``
over the timed calls (what the caching allocator holds, a CUDA graph's private pool
included; the fresh process holds nothing on the GPU before), in MiB.

Checks that it runs (not timings): ``--quick`` (1 repeat of 1 call, no memory processes);
``--tiny`` (the same models and code paths at toy sizes: hidden 32, 2 heads, 2 layers,
16 tokens, vocabularies of 1000, 32x32 images); ``--no-compile`` (no torch.compile side:
its first compile takes minutes a model). ``tests/benchmarks`` runs ``--tiny --quick --no-compile``.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

if __name__ == "__main__" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # torch.compile's first call should compile from nothing, as ipuxl's does
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_transformers_inductor_")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import transformers  # noqa: E402

import ipuxl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import one_ulp_away, passes, relative_distance  # noqa: E402

BATCH, ITERATIONS, LR = 2, 2, 1e-4
DEVICE = torch.device("cpu")  # ``--device`` sets it
SIDES = ("eager", "ipuxl", "compile")


@dataclass(frozen=True)
class Sizes:
    """The models' sizes: the benchmark's (``FULL``) or ``--tiny``'s (``TINY``: the same
    models and code paths at toy widths, for a fast check that everything runs)."""

    sequence: int
    target: int  # T5's target tokens
    image: int  # ViT's image side
    patch: int
    layers: dict[str, int]
    widths: dict[str, int]  # hidden, heads, ff of every model (empty: each config's own)
    vocab: dict[str, int]


FULL = Sizes(128, 32, 224, 16, dict(bert=4, gpt2=2, t5=6, vit=4), {}, dict(bert=30522, gpt2=50257, t5=32128))
TINY = Sizes(16, 8, 32, 8, dict(bert=2, gpt2=2, t5=2, vit=2), dict(hidden=32, heads=2, ff=64),
             dict(bert=1000, gpt2=1000, t5=1000))
SIZES = FULL  # ``--tiny`` sets TINY


@dataclass(frozen=True)
class Spec:
    """How to build one benchmark model and its data."""

    build: Callable[[], nn.Module]
    data: Callable[[int, torch.Generator], dict[str, torch.Tensor]]  # (rows, generator) -> model inputs


def _bert() -> nn.Module:
    w = SIZES.widths
    small = dict(hidden_size=w["hidden"], num_attention_heads=w["heads"], intermediate_size=w["ff"],
                 max_position_embeddings=4 * SIZES.sequence) if w else {}
    config = transformers.BertConfig(num_hidden_layers=SIZES.layers["bert"], vocab_size=SIZES.vocab["bert"],
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2, **small)
    return transformers.BertForSequenceClassification(config)


def _padding_mask(rows: int) -> torch.Tensor:
    mask = torch.ones(rows, SIZES.sequence, dtype=torch.long)
    mask[::BATCH, SIZES.sequence * 3 // 4:] = 0  # each micro-batch's first sequence ends in padding
    return mask


def _bert_data(rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return dict(input_ids=torch.randint(1, SIZES.vocab["bert"], (rows, SIZES.sequence), generator=gen),
                attention_mask=_padding_mask(rows), labels=torch.randint(0, 2, (rows,), generator=gen))


def _gpt2() -> nn.Module:
    w = SIZES.widths
    small = dict(n_embd=w["hidden"], n_head=w["heads"], n_positions=4 * SIZES.sequence) if w else {}
    config = transformers.GPT2Config(n_layer=SIZES.layers["gpt2"], vocab_size=SIZES.vocab["gpt2"], resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, **small)
    return transformers.GPT2LMHeadModel(config)


def _gpt2_data(rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, SIZES.vocab["gpt2"], (rows, SIZES.sequence), generator=gen)
    return dict(input_ids=ids, labels=ids)


def _t5() -> nn.Module:
    w = SIZES.widths
    sizes = (dict(d_model=w["hidden"], d_ff=w["ff"], d_kv=w["hidden"] // w["heads"], num_heads=w["heads"]) if w
             else dict(d_model=512, d_ff=2048, d_kv=64, num_heads=8))
    config = transformers.T5Config(num_layers=SIZES.layers["t5"], vocab_size=SIZES.vocab["t5"], dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0, **sizes)
    return transformers.T5ForConditionalGeneration(config)


def _t5_data(rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    vocab = SIZES.vocab["t5"]
    return dict(input_ids=torch.randint(1, vocab, (rows, SIZES.sequence), generator=gen),
                attention_mask=_padding_mask(rows), labels=torch.randint(1, vocab, (rows, SIZES.target), generator=gen))


def _vit() -> nn.Module:
    w = SIZES.widths
    small = dict(hidden_size=w["hidden"], num_attention_heads=w["heads"], intermediate_size=w["ff"]) if w else {}
    config = transformers.ViTConfig(num_hidden_layers=SIZES.layers["vit"], image_size=SIZES.image,
                                    patch_size=SIZES.patch, num_labels=10, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, **small)
    return transformers.ViTForImageClassification(config)


def _vit_data(rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return dict(pixel_values=torch.randn(rows, 3, SIZES.image, SIZES.image, generator=gen),
                labels=torch.randint(0, 10, (rows,), generator=gen))


MODELS: dict[str, Spec] = {"bert": Spec(_bert, _bert_data), "gpt2": Spec(_gpt2, _gpt2_data),
                           "t5": Spec(_t5, _t5_data), "vit": Spec(_vit, _vit_data)}


def build(name: str) -> nn.Module:
    """``MODELS[name]``'s model, seeded."""
    torch.manual_seed(0)
    return MODELS[name].build()


class Call:
    """One call's data: the combined batch (ipuxl) and its ``ITERATIONS`` micro-batches (eager)."""

    def __init__(self, inputs: dict[str, torch.Tensor]):
        self.inputs = inputs
        self.steps = [{k: v[i * BATCH:(i + 1) * BATCH] for k, v in inputs.items()} for i in range(ITERATIONS)]

    def on_device(self, step: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One micro-batch on ``DEVICE`` (eager and torch.compile copy each step's)."""
        return {k: v.to(DEVICE) for k, v in step.items()} if DEVICE.type != "cpu" else step

    def cast(self, dtype: torch.dtype) -> "Call":
        return Call({k: v.to(dtype) if v.is_floating_point() else v for k, v in self.inputs.items()})


def make_data(name: str, calls: int, seed: int = 1) -> list[Call]:
    gen = torch.Generator().manual_seed(seed)
    return [Call(MODELS[name].data(ITERATIONS * BATCH, gen)) for _ in range(calls)]


# -- the sides -----------------------------------------------------------------------------------
def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR)


class Eager:
    """The module and its AdamW, ``ITERATIONS`` steps per call in a Python loop."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float32):
        self.model, self.dtype = model.to(DEVICE), dtype
        self.opt = _adamw(model)

    def __call__(self, call: Call) -> None:
        for inputs in (call.steps if self.dtype == torch.float32 else call.cast(self.dtype).steps):
            self.opt.zero_grad()
            self.model(**call.on_device(inputs)).loss.backward()
            self.opt.step()


class Compiled:
    """The module and its AdamW, the whole training step compiled by ``torch.compile``
    (compiled autograd: backward and update too); ``model+opt`` where that fails."""

    def __init__(self, model: nn.Module):
        self.model = model.to(DEVICE)
        self.opt = _adamw(model)
        self.mode = "step"
        torch._dynamo.config.compiled_autograd = True
        self.step = torch.compile(self._step)

    def _step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.opt.zero_grad()
        loss = self.model(**inputs).loss
        loss.backward()
        self.opt.step()
        return loss.detach()

    def __call__(self, call: Call) -> None:
        for inputs in call.steps:
            inputs = call.on_device(inputs)
            try:
                self.step(inputs)
            except Exception:  # noqa: BLE001 - the whole step did not compile: the common fallback
                if self.mode != "step":
                    raise
                self._fall_back()
                self.step(inputs)

    def _fall_back(self) -> None:
        torch._dynamo.reset()
        torch._dynamo.config.compiled_autograd = False
        self.mode = "model+opt"
        model, opt_step = torch.compile(self.model), torch.compile(self.opt.step)

        def step(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            self.opt.zero_grad()
            loss = model(**inputs).loss
            loss.backward()
            opt_step()
            return loss.detach()

        self.step = step


class Ipuxl:
    def __init__(self, model: nn.Module):
        self.model = model
        self.ipu = ipuxl.trainingModel(model, ipuxl.Options().deviceIterations(ITERATIONS), optimizer=_adamw(model))

    def __call__(self, call: Call) -> None:
        self.ipu(**call.inputs)

    def state(self) -> dict[str, torch.Tensor]:
        self.ipu.copyWeightsToHost()
        return _state(self.model)

    def free(self) -> None:
        self.ipu.destroy()

    @property
    def graphs(self) -> str:
        """Whether the calls replay CUDA graphs: ``yes``, ``no (why)``, or ``-`` off CUDA."""
        runs = self.ipu.session.cuda_graphs if self.ipu.session is not None else None
        if runs is None:
            return "-"
        return "yes" if runs.replays else f"no ({runs.reason or 'not yet captured'})"


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def synchronize() -> None:
    """Wait for ``DEVICE``'s queued work (a timing must include it)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def make_side(side: str, model: nn.Module) -> Callable[[Call], None]:
    return {"eager": Eager, "ipuxl": Ipuxl, "compile": Compiled}[side](model)


# -- one model: first calls, the weight check, timings --------------------------------------------
@dataclass
class Result:
    name: str
    ms: dict[str, float]
    first: dict[str, tuple[float, float]]  # side -> (first call s, second call s)
    err: dict[str, float]  # ipuxl, eager, other (one ulp away), compile
    worst: str
    compile_mode: str
    graphs: str = "-"  # whether ipuxl's calls replay CUDA graphs (``Ipuxl.graphs``)
    memory: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return passes(self.err["ipuxl"], max(self.err["eager"], self.err["other"]))


def bench_model(name: str, calls: int, repeats: int, check_calls: int, with_compile: bool = True) -> Result:
    """One model's first calls, weight check and timings (``with_compile`` False: no
    torch.compile side, its columns nan)."""
    gc.collect()
    model = build(name)
    copies = {"eager": copy.deepcopy(model), "float64": copy.deepcopy(model).double(),
              "other": one_ulp_away(copy.deepcopy(model))}
    sides: dict[str, Any] = {"ipuxl": Ipuxl(model), "eager": Eager(copies["eager"]),
                             "float64": Eager(copies["float64"], torch.float64), "other": Eager(copies["other"])}
    if with_compile:
        copies["compile"] = copy.deepcopy(copies["eager"])
        sides["compile"] = Compiled(copies["compile"])
    timed = [k for k in SIDES if k in sides]
    try:
        first: dict[str, list[float]] = {k: [] for k in timed}
        for i, call in enumerate(make_data(name, max(check_calls, 2), seed=123)):
            for side, run in sides.items():
                start = time.perf_counter()
                run(call)
                synchronize()
                if side in first and i < 2:
                    first[side].append(time.perf_counter() - start)
        states = {"ipuxl": sides["ipuxl"].state(), **{k: _state(m) for k, m in copies.items()}}
        reference = states.pop("float64")
        err_ipu, worst = relative_distance(states["ipuxl"], reference)
        err = {"ipuxl": err_ipu, "compile": math.nan, **{k: relative_distance(states[k], reference)[0]
                                                         for k in ("eager", "other", "compile") if k in states}}
        for k in ("float64", "other"):
            del sides[k], copies[k]
        gc.collect()
        ms = {"compile": math.nan, **alternate_timings({k: sides[k] for k in timed}, make_data(name, min(calls, 4)),
                                                        calls, repeats)}
        firsts = {"compile": (math.nan, math.nan), **{k: (v[0], v[1]) for k, v in first.items()}}
        return Result(name, ms, firsts, err, worst, sides["compile"].mode if with_compile else "-",
                      sides["ipuxl"].graphs)
    finally:
        sides["ipuxl"].free()
        torch._dynamo.reset()


def alternate_timings(sides: dict[str, Callable[[Call], None]], data: list[Call], calls: int,
                      repeats: int) -> dict[str, float]:
    """Median ms per call of each side: one warm-up timing each, then ``repeats`` rounds,
    the sides' order rotating by round."""
    def timing(run: Callable[[Call], None]) -> float:
        start = time.perf_counter()
        for i in range(calls):
            run(data[i % len(data)])
        synchronize()
        return (time.perf_counter() - start) / calls * 1e3

    names = list(sides)
    for name in names:
        timing(sides[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(timing(sides[name]))
    return {name: statistics.median(t) for name, t in times.items()}


# -- peak memory: each side alone in a fresh process ----------------------------------------------
def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", open("/proc/self/status").read(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def memory_of_side(name: str, side: str, calls: int) -> float:
    """(In this process: call it in a fresh one.) Peak RSS in MiB over ``calls`` calls of
    ``side`` after its first call, above the RSS after the imports."""
    base = _status_kib("VmRSS")
    run = make_side(side, build(name))
    data = make_data(name, min(calls, 4))
    run(data[0])
    synchronize()
    if DEVICE.type == "cuda":  # the GPU's memory, not the host's (module docstring)
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
    for i in range(calls):
        run(data[i % len(data)])
    synchronize()
    if DEVICE.type == "cuda":
        return torch.cuda.max_memory_reserved() / 2**20
    return (_status_kib("VmHWM") - base) / 1024


def measure_memory(name: str, calls: int, threads: int | None, sides: tuple[str, ...] = SIDES
                   ) -> dict[str, float] | None:
    """Each of ``sides``' ``memory_of_side`` from a fresh process; None where /proc is not Linux's."""
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    out = {}
    for side in sides:
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-of", f"{name}:{side}", "--calls", str(calls)]
        if threads:
            cmd += ["--threads", str(threads)]
        if SIZES is TINY:
            cmd.append("--tiny")
        cmd += ["--device", DEVICE.type]
        done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        out[side] = json.loads(lines[-1])["mib"] if done.returncode == 0 and lines else math.nan
    return out


# -- the report ----------------------------------------------------------------------------------
def geomean(values: list[float]) -> float:
    """The geometric mean of the values that are not nan (nan: none)."""
    values = [v for v in values if not math.isnan(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--repeats", type=int, default=5, help="timings per side (median)")
    parser.add_argument("--calls", type=int, default=2, help=f"calls ({ITERATIONS} steps each) per timing")
    parser.add_argument("--check-calls", type=int, default=2, help="calls trained by the weight check (>= 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat of 1 call, no memory")
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile side (its columns: nan)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (hidden 32, 2 layers, 16 tokens): a fast check")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where every side trains (default: cuda where present)")
    parser.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # MODEL:SIDE, in a fresh process
    opts = parser.parse_args(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if opts.device == "cpu" and torch.cuda.is_available():
        parser.error("--device cpu: trainingModel runs on ipu_hw, which is CUDA on this machine; "
                     "run with --device cuda, or hide the GPU (CUDA_VISIBLE_DEVICES=) to compare on the CPU")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    global SIZES, DEVICE
    SIZES = TINY if opts.tiny else FULL
    DEVICE = torch.device(opts.device)
    if opts.memory_of:
        name, side = opts.memory_of.split(":")
        print(json.dumps({"mib": memory_of_side(name, side, opts.calls)}))
        return []
    if opts.quick:
        opts.repeats, opts.calls, opts.no_memory = 1, 1, True
    names = opts.models.split(",")
    if set(names) - set(MODELS):
        parser.error(f"--models {opts.models}: unknown {sorted(set(names) - set(MODELS))}; "
                     f"choose from {', '.join(MODELS)}")
    where = torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else f"cpu, threads {torch.get_num_threads()}"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {where}, "
          f"micro-batch {BATCH} x {SIZES.sequence} tokens, {ITERATIONS} steps/call, AdamW, repeats {opts.repeats}, "
          f"calls/timing {opts.calls}" + (", TINY sizes" if SIZES is TINY else ""), flush=True)
    start, results, failed = time.perf_counter(), [], []
    for name in names:
        try:
            result = bench_model(name, opts.calls, opts.repeats, max(opts.check_calls, 2), not opts.no_compile)
        except Exception as e:  # one model's failure should not hide the others' numbers
            failed.append(name)
            print(f"{name}: FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            continue
        if not opts.no_memory:
            sides = tuple(k for k in SIDES if k != "compile" or not opts.no_compile)
            result.memory = measure_memory(name, opts.calls, opts.threads, sides)
        results.append(result)
        _print_row(result)
    _print_tables(results, failed, time.perf_counter() - start)
    return results


def _print_row(r: Result) -> None:
    mem = r.memory or {}
    print(f"{r.name}: eager {r.ms['eager']:.1f} ms, ipuxl {r.ms['ipuxl']:.1f} ms, "
          f"torch.compile {r.ms['compile']:.1f} ms per call; weights {'ok' if r.ok else 'MISMATCH'}; first call "
          f"ipuxl {r.first['ipuxl'][0]:.1f} s, torch.compile {r.first['compile'][0]:.1f} s; peak MiB "
          + ", ".join(f"{k} {v:.0f}" for k, v in mem.items()) + (f"; CUDA graphs {r.graphs}" if r.graphs != "-" else ""),
          flush=True)


def _print_tables(results: list[Result], failed: list[str], seconds: float) -> None:
    head = (f"{'model':<6} {'eager ms':>9} {'ipuxl ms':>9} {'compile ms':>10} {'eager/ipuxl':>11} "
            f"{'compile/ipuxl':>13} {'err ipuxl':>9} {'err eager':>9} {'err other':>9} {'err compile':>11}  weights"
            + ("   CUDA graphs" if DEVICE.type == "cuda" else ""))
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        print(f"{r.name:<6} {r.ms['eager']:>9.1f} {r.ms['ipuxl']:>9.1f} {r.ms['compile']:>10.1f} "
              f"{r.ms['eager'] / r.ms['ipuxl']:>11.3f} {r.ms['compile'] / r.ms['ipuxl']:>13.3f} "
              f"{r.err['ipuxl']:>9.2e} {r.err['eager']:>9.2e} {r.err['other']:>9.2e} {r.err['compile']:>11.2e}  "
              + ("ok" if r.ok else f"MISMATCH (worst: {r.worst})")
              + (f"   {r.graphs}" if DEVICE.type == "cuda" else ""))
    head = (f"{'model':<6} {'first call s: ipuxl':>19} {'compile':>8} {'2nd call s: ipuxl':>17} {'compile':>8} "
            f"{'compiled':>9}   {'GPU MiB: eager' if DEVICE.type == 'cuda' else 'peak MiB: eager':>15} {'ipuxl':>6} "
            f"{'compile':>7}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        mem = r.memory or {}
        print(f"{r.name:<6} {r.first['ipuxl'][0]:>19.1f} {r.first['compile'][0]:>8.1f} {r.first['ipuxl'][1]:>17.1f} "
              f"{r.first['compile'][1]:>8.1f} {r.compile_mode:>9}   "
              + " ".join(f"{mem.get(s, math.nan):>{w}.0f}" for s, w in (("eager", 15), ("ipuxl", 6), ("compile", 7))))
    if results:
        vs_eager = [r.ms["eager"] / r.ms["ipuxl"] for r in results]
        vs_compile = [r.ms["compile"] / r.ms["ipuxl"] for r in results]
        print(f"\ngeometric mean eager/ipuxl {geomean(vs_eager):.3f}, compile/ipuxl {geomean(vs_compile):.3f} "
              f"over {len(results)} models; below 1.0 vs eager: "
              f"{[r.name for r, v in zip(results, vs_eager) if v < 1.0] or 'none'}; slower than torch.compile: "
              f"{[r.name for r, v in zip(results, vs_compile) if v < 1.0] or 'none'}")
    mismatched = [r.name for r in results if not r.ok]
    print(f"weight check: {len(results) - len(mismatched)} ok, {len(mismatched)} mismatch"
          + (f" ({', '.join(mismatched)})" if mismatched else "")
          + (f"; {len(failed)} failed to run ({', '.join(failed)})" if failed else ""))
    print(f"total time {seconds:.1f} s")


if __name__ == "__main__":
    main()
