"""Training speed of torchvision models through ipuxl's ``trainingModel`` against eager PyTorch.

Run:   python benchmarks/bench_models.py [--models resnet18,vit] [--repeats 7] [--calls 10]
                                         [--threads T] [--quick]

What it measures: milliseconds per call of SGD training (lr 0.01, momentum 0.9) of
torchvision classification models (``MODELS``; num_classes 10, every ``nn.Dropout`` and
``StochasticDepth`` at p = 0) with CrossEntropyLoss, micro-batch 4 of 3x64x64 images.
ipuxl: ``ipuxl.trainingModel(WithLoss(model), Options().deviceIterations(2), optimizer=SGD)``,
so one call trains 2 steps on the combined batch of 8. Eager: a deep copy of the same
module (same initial weights, made before wrapping: ipuxl swaps the module classes)
trains the same 2 steps per call in a Python loop (zero_grad, forward, loss, backward,
step) over the same pre-generated data (not timed).

How, per model: the ipuxl compile (``model.compile``) is timed once, for information.
Then the weight check (``check_weights``): ipuxl and eager train ``--check-calls`` calls
and are compared with a float64 eager run from the same weights and data. Deep nets at
batch 4 are ill-conditioned in float32 (chaotic: rounding differences grow to O(1) in
some BatchNorm parameters within 6 steps), so the check does not ask ipuxl to match
eager float32; it asks ipuxl to be about as close to float64 as eager float32 is. With
err(side) the largest relative L2 distance from float64 over the parameters and floating
buffers (BatchNorm running statistics; ``relative_distance``), and err(eager32) the largest
of three legitimate float32 runs, eager with the default and with the channels-last memory
format (they round differently, and on ResNet-18 one ends 150x further from float64 than
the other), and eager with every initial weight one float32 ulp away (``one_ulp_away``:
the same weights rounded otherwise; SqueezeNet channels-last is chaotic at that level, a
1-ulp start ending 1e-2 from float64 in 6 steps while the unperturbed run stays at 1e-6),
it passes when err(ipuxl) <= max(2 * err(eager32), 1e-5) and integer buffers are equal.
The table's "err other" is the larger of the last two runs'. The check is tight where
float32 is well conditioned (ConvNeXt, ViT, Swin: all float32 runs ~1e-6 off); where
eager float32 itself is O(1) off (most of the BatchNorm CNNs) it only bounds ipuxl's error.

Timings: one untimed warm-up timing per side and ``--repeats`` alternating timings of
``--calls`` calls; each side's median is reported (``bench_mlp.alternate_timings``)
and the ratio eager ms / ipuxl ms (> 1: ipuxl is faster). At the end: the geometric
mean of the ratios and how many models are below 0.95. A model that fails to train is
reported and counted, and the run goes on. On a small or shared machine,
``--threads 1`` gives steadier numbers.
"""
from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import sys
import time
from typing import Callable

import torch
import torch.nn as nn
import torchvision
from torchvision.ops import StochasticDepth

import ipuxl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mlp import alternate_timings  # noqa: E402

BATCH, ITERATIONS, IMAGE, LR, MOMENTUM = 4, 2, 64, 0.01, 0.9
#: the check's tolerance: ipuxl may be this many times further from float64 than eager float32 ...
FACTOR = 2.0
#: ... or this far, whichever is larger (well-conditioned nets: eager float32 is ~1e-6 off)
FLOOR = 1e-5
#: an entry's distance is relative to its norm, or to this RMS where smaller: an entry whose exact
#: gradient is 0 (the bias of a BatchNorm followed by a 1x1 conv and another BatchNorm) holds
#: rounding noise (~1e-8 in float32, ~1e-17 in float64), and noise relative to noise means nothing
RMS_FLOOR = 1e-4

_tv = torchvision.models
MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: _tv.resnet18(num_classes=10),
    "resnet50": lambda: _tv.resnet50(num_classes=10),
    "mobilenet_v2": lambda: _tv.mobilenet_v2(num_classes=10),
    "mobilenet_v3_large": lambda: _tv.mobilenet_v3_large(num_classes=10),
    "efficientnet_b0": lambda: _tv.efficientnet_b0(num_classes=10),
    "shufflenet_v2_x1_0": lambda: _tv.shufflenet_v2_x1_0(num_classes=10),
    "densenet121": lambda: _tv.densenet121(num_classes=10),
    "regnet_y_400mf": lambda: _tv.regnet_y_400mf(num_classes=10),
    "convnext_tiny": lambda: _tv.convnext_tiny(num_classes=10),
    "vit": lambda: _tv.VisionTransformer(image_size=64, patch_size=8, num_layers=4, num_heads=4,
                                         hidden_dim=128, mlp_dim=256, num_classes=10),
    "swin_t": lambda: _tv.swin_t(num_classes=10),
    "googlenet": lambda: _tv.googlenet(num_classes=10, aux_logits=False, init_weights=True),
    "mnasnet1_0": lambda: _tv.mnasnet1_0(num_classes=10),
    "squeezenet1_0": lambda: _tv.squeezenet1_0(num_classes=10),
}


class WithLoss(nn.Module):
    """``model`` followed by CrossEntropyLoss: ``forward(x, y) -> (logits, loss)``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(x)
        return out, self.loss(out, y)


def build(name: str) -> WithLoss:
    """``MODELS[name]`` (seeded) with its dropout and stochastic depth off, wrapped with the loss."""
    torch.manual_seed(0)
    model = MODELS[name]()
    for m in model.modules():
        if isinstance(m, (nn.Dropout, StochasticDepth)):
            m.p = 0.0
    return WithLoss(model)


# -- the sides: ipuxl and eager (float32; for the check also float64 and channels-last float32) --
class Eager:
    """An eager copy of the module with its optimiser; ``cast`` converts the images."""

    def __init__(self, module: nn.Module, cast: Callable[[torch.Tensor], torch.Tensor] = lambda x: x):
        self.model, self.cast = module, cast
        self.opt = _sgd(module)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, per_step: list) -> None:
        eager_steps(self.model, self.opt, [(self.cast(xs), ys) for xs, ys in per_step])


class Sides:
    """ipuxl and eager float32 from one initial module; with ``check``, also the check's
    eager float64 reference and eager float32 in channels-last memory format."""

    def __init__(self, name: str, check: bool = False):
        self.wrapped = build(name)
        self.eager = Eager(copy.deepcopy(self.wrapped))  # before wrapping: ipuxl swaps the module classes
        self.checks: dict[str, Eager] = {}
        if check:
            channels_last = torch.channels_last
            self.checks = {"float64": Eager(copy.deepcopy(self.wrapped).double(), lambda x: x.double()),
                           "channels_last": Eager(copy.deepcopy(self.wrapped).to(memory_format=channels_last),
                                                  lambda x: x.contiguous(memory_format=channels_last)),
                           "one_ulp": Eager(one_ulp_away(copy.deepcopy(self.wrapped)))}
        self.ipu = ipuxl.trainingModel(self.wrapped, ipuxl.Options().deviceIterations(ITERATIONS),
                                       optimizer=_sgd(self.wrapped))

    def run_ipu(self, x: torch.Tensor, y: torch.Tensor, per_step: list) -> None:
        self.ipu(x, y)

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        """State dicts (parameters and buffers) of every side: ``ipuxl``, ``eager`` and the checks'."""
        self.ipu.copyWeightsToHost()
        return {"ipuxl": _detached(self.wrapped), "eager": _detached(self.eager.model),
                **{k: _detached(e.model) for k, e in self.checks.items()}}

    def free(self) -> None:
        self.ipu.destroy()
        del self.ipu, self.wrapped, self.eager, self.checks
        gc.collect()


def one_ulp_away(model: nn.Module, seed: int = 7) -> nn.Module:
    """``model`` with every parameter element moved one float32 ulp up or down (seeded): the
    same initial weights, rounded to float32 otherwise (the check's third float32 run)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            up = torch.rand(p.shape, generator=gen) < 0.5
            p.copy_(torch.nextafter(p, torch.where(up, math.inf, -math.inf).to(p.dtype)))
    return model


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _detached(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def eager_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: list) -> None:
    for x, y in steps:
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()


def make_data(calls: int, seed: int = 1) -> list[tuple]:
    """``calls`` of (combined images (2*4, 3, 64, 64), labels (8,), eager's per-step [(x, y)])."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(calls):
        x = torch.randn(ITERATIONS * BATCH, 3, IMAGE, IMAGE, generator=g)
        y = torch.randint(0, 10, (ITERATIONS * BATCH,), generator=g)
        out.append((x, y, list(zip(x.view(ITERATIONS, BATCH, *x.shape[1:]).unbind(0),
                                   y.view(ITERATIONS, BATCH).unbind(0)))))
    return out


# -- the weight check ----------------------------------------------------------------------------
def relative_distance(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest relative L2 distance ``||a - ref|| / max(||ref||, RMS_FLOOR * sqrt(numel))`` over
    the floating entries, and the worst entry's name; ``inf`` where an integer entry (a
    BatchNorm step count) differs or the names differ."""
    if state.keys() != reference.keys():
        return math.inf, f"names differ: {sorted(state.keys() ^ reference.keys())[:4]}"
    worst, where = -1.0, ""
    for k, ref in reference.items():
        a = state[k]
        if not ref.is_floating_point():
            err = 0.0 if torch.equal(a.to(ref.dtype), ref) else math.inf
        else:
            scale = max(ref.double().norm().item(), RMS_FLOOR * math.sqrt(ref.numel()))
            err = (a.double() - ref.double()).norm().item() / scale
        if err > worst:
            worst, where = err, k
    return max(worst, 0.0), where


def passes(err_ipuxl: float, err_eager32: float) -> bool:
    """The check's rule: ipuxl about as close to float64 as eager float32 is."""
    return err_ipuxl <= max(FACTOR * err_eager32, FLOOR)


def weight_errors(sides: Sides, calls: int) -> tuple[float, float, float, str]:
    """Train every side ``calls`` calls: the distances from float64 of ipuxl, eager float32 and
    the larger of the other two float32 runs' (channels-last, one ulp away), and ipuxl's worst entry."""
    runs: list[Callable[[torch.Tensor, torch.Tensor, list], None]] = [sides.run_ipu, sides.eager,
                                                                      *sides.checks.values()]
    for x, y, per_step in make_data(calls, seed=123):
        for run in runs:
            run(x, y, per_step)
    states = sides.states()
    reference = states["float64"]
    err_ipu, where = relative_distance(states["ipuxl"], reference)
    others = max(relative_distance(states[k], reference)[0] for k in ("channels_last", "one_ulp"))
    return err_ipu, relative_distance(states["eager"], reference)[0], others, where


def check_weights(name: str, calls: int = 3) -> tuple[float, float, bool]:
    """Train ``MODELS[name]`` ``calls`` calls (2 steps each) from one init with ipuxl, eager
    float32 (three runs) and eager float64: ``(err_ipuxl, err_eager32, ok)``, with
    ``err_eager32`` the largest of the float32 runs' (see the module docstring)."""
    sides = Sides(name, check=True)
    try:
        err_ipu, err_eager, err_cl, _ = weight_errors(sides, calls)
    finally:
        sides.free()
    err_eager32 = max(err_eager, err_cl)
    return err_ipu, err_eager32, passes(err_ipu, err_eager32)


# -- the benchmark -------------------------------------------------------------------------------
def bench_model(name: str, calls: int, repeats: int, check_calls: int) -> tuple[float, float, float, tuple]:
    """(compile s, eager ms/call, ipuxl ms/call, ``weight_errors``) of one model."""
    gc.collect()  # earlier models' executors (reference cycles) would stay live and be scanned per call
    sides = Sides(name, check=True)
    try:
        data = make_data(min(calls, 4))
        start = time.perf_counter()
        sides.ipu.compile(data[0][0], data[0][1])
        compile_s = time.perf_counter() - start
        errors = weight_errors(sides, check_calls)
        sides.checks.clear()  # not timed: free them
        ipu_cps, eager_cps = alternate_timings(sides.run_ipu, sides.eager, data, calls, repeats, calls)
    finally:
        sides.free()
    return compile_s, 1e3 / eager_cps, 1e3 / ipu_cps, errors


def main(argv: list[str] | None = None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--repeats", type=int, default=7, help="timings per side (median)")
    parser.add_argument("--calls", type=int, default=10, help=f"calls ({ITERATIONS} steps each) per timing")
    parser.add_argument("--check-calls", type=int, default=3, help="calls trained by the weight check")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 repeats of 2 calls")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.calls = 2, 2
    if opts.threads:
        torch.set_num_threads(opts.threads)
    names = opts.models.split(",")
    if set(names) - set(MODELS):
        parser.error(f"--models {opts.models}: unknown {sorted(set(names) - set(MODELS))}; "
                     f"choose from {', '.join(MODELS)}")
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, threads {torch.get_num_threads()}, "
          f"batch {BATCH}x3x{IMAGE}x{IMAGE}, {ITERATIONS} steps/call, repeats {opts.repeats}, "
          f"calls/timing {opts.calls}")
    header = (f"{'model':<19} {'compile s':>9} {'eager ms':>9} {'ipuxl ms':>9} {'eager/ipuxl':>11} "
              f"{'err ipuxl':>9} {'err eager':>9} {'err other':>9}  weights")
    print(header + "\n" + "-" * len(header))
    start, rows, failed = time.perf_counter(), [], []
    for name in names:
        try:
            compile_s, eager_ms, ipu_ms, (err_ipu, err_eager, err_cl, where) = bench_model(
                name, opts.calls, opts.repeats, opts.check_calls)
        except Exception as e:  # one model's failure should not hide the others' numbers
            failed.append(name)
            print(f"{name:<19} FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            continue
        ok = passes(err_ipu, max(err_eager, err_cl))
        rows.append((name, eager_ms, ipu_ms, err_ipu, err_eager, err_cl, ok))
        print(f"{name:<19} {compile_s:>9.2f} {eager_ms:>9.2f} {ipu_ms:>9.2f} {eager_ms / ipu_ms:>11.3f} "
              f"{err_ipu:>9.2e} {err_eager:>9.2e} {err_cl:>9.2e}  {'ok' if ok else f'MISMATCH (worst: {where})'}",
              flush=True)
    _summary(rows, failed, time.perf_counter() - start)
    return rows


def _summary(rows: list[tuple], failed: list[str], seconds: float) -> None:
    ratios = [eager_ms / ipu_ms for _, eager_ms, ipu_ms, *_ in rows]
    if ratios:
        geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        slow = [name for (name, *_), r in zip(rows, ratios) if r < 0.95]
        print(f"geometric mean eager/ipuxl {geomean:.3f} over {len(ratios)} models; below 0.95: {len(slow)}"
              + (f" ({', '.join(slow)})" if slow else ""))
    mismatched = [name for name, *_, ok in rows if not ok]
    print(f"weight check: {len(rows) - len(mismatched)} ok, {len(mismatched)} mismatch"
          + (f" ({', '.join(mismatched)})" if mismatched else "")
          + (f"; {len(failed)} failed to run ({', '.join(failed)})" if failed else ""))
    print(f"total time {seconds:.1f} s")


if __name__ == "__main__":
    main()
