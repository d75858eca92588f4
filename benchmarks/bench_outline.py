"""Capture, passes and compile time of a deep residual MLP, with and without outlining.

Run:   python benchmarks/bench_outline.py [--block residual|mlp] [--blocks 4,12,48] [--repeats 3] [--width 64]

The model is N identical blocks then a Linear head and cross-entropy, wrapped with
``ipuxl.trainingModel`` (SGD) and compiled for batch 16 with
``Options().autoOutline(True | False)``. Blocks (``--block``):

* ``residual``: ``x + 0.1 * tanh(Linear(x))`` (5 forward ops, 2 parameters);
* ``mlp``: a transformer's MLP block, ``x + Linear(GELU(Linear(LayerNorm(x))))``
  with a 2x wider hidden layer (6 parameters).

Phases, timed by wrapping the steps of ``compile_model`` (median of ``--repeats`` fresh models):

* capture: ``capture`` (make_fx of forward + loss; with outlining each kind of
  block is traced once and its other runs are recorded as calls);
* passes: ``import_forward``, ``differentiate`` and ``build_program`` (the IR import;
  autodiff, which differentiates a called block once and builds the grad graph from
  calls at the IR level; the step program);
* outline: ``outline_program`` (``passes.outline.outline_ir``, when on: what capture
  did not outline, such as the optimiser's per-weight updates);
* compile: ``Session(...)`` (lowering every graph to Python code once, the resource check);

plus the program size the IPU resource model charges (op instances, each graph once)
and the weights after one training step compared with eager PyTorch for both variants
(outlining changes no arithmetic, but inlined code lets the device fuse a weight
gradient's matmul into its update, which rounds differently in the last bits).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import ipuxl
import ipuxl.poptorch_compat.compile.compile_model as compile_steps
import ipuxl.poptorch_compat.runtime.compiled_model as compiled_model
from ipuxl.ir.calls import CallTarget
from ipuxl.ir.meta import OP
from ipuxl.poptorch_compat.compile.program import Program


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.tanh(self.fc(x))


class MLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


BLOCKS = {"residual": Block, "mlp": MLPBlock}


class Net(nn.Module):
    def __init__(self, blocks: int, width: int, block: str = "residual"):
        super().__init__()
        self.blocks = nn.Sequential(*[BLOCKS[block](width) for _ in range(blocks)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        out = self.head(self.blocks(x))
        return out, F.cross_entropy(out, y)


class PhaseTimer:
    """Times the compile steps (``poptorch_compat.compile.compile_model``) and the executor's Session, by phase."""

    # (module, function, phase): the passes phase is the IR import, autodiff and the step program
    STEPS = ((compile_steps, "capture", "capture"), (compile_steps, "import_forward", "passes"),
             (compile_steps, "differentiate", "passes"), (compile_steps, "build_program", "passes"),
             (compile_steps, "outline_program", "outline"), (compiled_model, "Session", "compile"))

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.programs: list[Any] = []

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
            if isinstance(result, Program):
                self.programs.append(result)
            return result

        return timed

    def __enter__(self) -> "PhaseTimer":
        self._saved = [getattr(module, attr) for module, attr, _ in self.STEPS]
        for (module, attr, phase), fn in zip(self.STEPS, self._saved):
            setattr(module, attr, self._wrap(phase, fn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for (module, attr, _), fn in zip(self.STEPS, self._saved):
            setattr(module, attr, fn)


def code_ops(ir: Any) -> int:
    """Op instances in compiled code: every graph once; calls and tuple items not counted."""
    return sum(1 for g in ir.graphs for n in g.fx.nodes
               if n.op == "call_function" and not isinstance(n.target, CallTarget)
               and n.meta.get(OP) != "output_of" and getattr(n.target, "__name__", "") != "getitem")


def compile_once(blocks: int, width: int, outline: bool, block: str, seed: int = 0):
    torch.manual_seed(seed)
    net = Net(blocks, width, block)
    opts = ipuxl.Options().autoOutline(outline)
    model = ipuxl.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.05))
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(2))
    with PhaseTimer() as timer:
        model.compile(x, y)
    model(x, y)
    weights = [p.detach().clone() for p in net.parameters()]
    return timer, weights


def eager_step(blocks: int, width: int, block: str, seed: int = 0) -> list[torch.Tensor]:
    """The weights after the same compile-then-train call's one step, in eager PyTorch."""
    torch.manual_seed(seed)
    net = Net(blocks, width, block)
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    _, loss = net(x, y)
    loss.backward()
    opt.step()
    return [p.detach().clone() for p in net.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", choices=sorted(BLOCKS), default="residual")
    parser.add_argument("--blocks", default="4,12,48")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = [int(b) for b in args.blocks.split(",")]
    compile_once(2, args.width, True, args.block)  # warm-up: imports, first make_fx
    rows = []
    for blocks in counts:
        for outline in (False, True):
            phases: dict[str, list[float]] = {"capture": [], "passes": [], "outline": [], "compile": []}
            for _ in range(args.repeats):
                timer, weights = compile_once(blocks, args.width, outline, args.block)
                for k in phases:
                    phases[k].append(timer.times.get(k, 0.0))
            ir = timer.programs[-1].ir
            rows.append((blocks, outline, {k: statistics.median(v) for k, v in phases.items()}, code_ops(ir),
                         len(ir.graphs), weights))
    print(f"block: {args.block}, width {args.width}")
    print(f"{'blocks':>6} {'outline':>7} {'capture s':>9} {'passes s':>8} {'outline s':>9} {'compile s':>9} "
          f"{'total s':>7} {'code ops':>8} {'graphs':>6}")
    for blocks, outline, t, ops, graphs, _ in rows:
        total = sum(t.values())
        print(f"{blocks:>6} {str(outline):>7} {t['capture']:>9.3f} {t['passes']:>8.3f} {t['outline']:>9.3f} "
              f"{t['compile']:>9.3f} {total:>7.3f} {ops:>8} {graphs:>6}")
    print()
    by = {(b, o): (t, ops, w) for b, o, t, ops, _, w in rows}
    first, last = counts[0], counts[-1]
    for outline in (False, True):
        t0, t1 = by[(first, outline)][0], by[(last, outline)][0]
        print(f"outline={outline}: {last}/{first} blocks = {last / first:.0f}x; compile time x"
              f"{t1['compile'] / t0['compile']:.2f}, capture+passes+compile x{sum(t1.values()) / sum(t0.values()):.2f}, "
              f"code ops x{by[(last, outline)][1] / by[(first, outline)][1]:.2f}; "
              f"each added block costs {1000 * (sum(t1.values()) - sum(t0.values())) / (last - first):.1f} ms")
    for blocks in counts:
        eager = eager_step(blocks, args.width, args.block)
        diffs = [max(float((a - b).abs().max()) for a, b in zip(by[(blocks, o)][2], eager)) for o in (False, True)]
        print(f"{blocks} blocks: weights after one step, max |ipuxl - eager|: inlined {diffs[0]:.2e}, "
              f"outlined {diffs[1]:.2e}")

if __name__ == "__main__":
    main()
