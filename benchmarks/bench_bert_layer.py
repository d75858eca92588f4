"""One BERT encoder layer as Graphcore's BERT PopXL application builds it, trained on ipuxl,
against Hugging Face's ``BertLayer`` in eager PyTorch.

Run:   python benchmarks/bench_bert_layer.py [--batch 1] [--steps 8] [--repeats 7] [--threads T]
                                             [--apps DIR] [--quick]

What it measures: milliseconds per training step (forward, backward, AdamW update) of one
encoder layer at BERT-base shapes (hidden 768, 12 heads, intermediate 3072, sequence
128), micro-batch ``--batch``, float32, no dropout, with a padding mask (the first
sequence ends in 32 padding tokens) and a fixed random gradient of the layer's output
(the loss is ``sum(output * dy)``); the input's gradient is computed too, as a layer in a
model needs it.

ipuxl: the application's own ``modelling.bert_model.BertLayer`` (from
``../shared/reference/apps/bert_popxl``, or ``--apps``), imported through
``ipuxl.compat`` as the application's tests import it (``popxl``, ``popxl_addons`` are
ipuxl's), built as the application builds a layer: ``BertLayer(config).create_graph``,
``addons.autodiff`` for its gradient graph (input and weight gradients), and one
``popxl_addons.optimizers.adam.AdamOptimizerStep`` graph per weight with the
application's optimiser settings (AdamW: beta1 0.9, beta2 0.999, eps 1e-6, weight decay
0.01 except on layer norms and biases, bias correction, float32 moments; the learning
rate 1e-4 a tensor, as the application streams it). The main program loads x, the mask
and dy, calls the forward and the gradient graph, runs the optimiser steps and stores
the input's gradient, in the body of PopXL's device loop (``ops.repeat`` of ``--steps``
steps, ``ir.num_host_transfers = --steps``): one ``Session.run`` trains ``--steps`` steps.

Eager: Hugging Face's ``BertLayer`` (the installed ``transformers``) computing the same
function (GELU's tanh form, ``gelu_pytorch_tanh``, as PopXL's ``gelu``; layer norm eps
1e-5, as ``popxl_addons.layers.LayerNorm``'s), with the same weights (mapped with the
application's own ``hf_mapping`` functions, as its tests do), ``torch.optim.AdamW`` with
the same parameter groups and settings, the same data.

Check: after ``--check-steps`` steps from the same weights, each weight's update (its
change from the initial weights) must be within 2% of eager's in relative L2 distance
(Adam turns float32 rounding in a near-zero gradient element into a step of up to the
learning rate, so elementwise equality is not expected; a wrong gradient or update is
off by its own size), and the last input gradient must equal eager's
(``torch.testing.assert_close``, rtol 1e-3, atol 1e-4: its last step reads weights that differ
as above). The attention key's bias is not
compared: its true gradient is zero and Adam turns rounding noise into full steps in both
runs.

Timings: one untimed warm-up timing per side, then ``--repeats`` alternating timings of
``--steps`` steps; each side's median is reported with the ratio eager ms / ipuxl ms (> 1:
ipuxl is faster). On a small or shared machine, ``--threads 1`` gives steadier numbers.
"""
from __future__ import annotations

import argparse
import os
import runpy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_APPS = Path(os.environ.get("IPUXL_APPS_DIR", ROOT.parent / "shared" / "reference" / "apps"))
HIDDEN, HEADS, SEQUENCE, LR, EPS, WEIGHT_DECAY = 768, 12, 128, 1e-4, 1e-6, 0.01
TOL = dict(rtol=1e-3, atol=1e-4)
#: the weight updates of the two sides may differ by this much (relative L2): Adam divides
#: each gradient element by its running size, so an element whose gradient is near zero
#: takes a step of up to the learning rate either way from float32 rounding alone
UPDATE_TOL = 2e-2


def load_app(apps: Path) -> dict[str, Any]:
    """The application's modules, imported through ``ipuxl.compat`` (its tests' way)."""
    import ipuxl.compat

    ipuxl.compat.install()
    # the application's configs nest dataclass instances as defaults: Python 3.10's rule (its shim)
    os.environ.setdefault("PY310_DATACLASS", "1")
    runpy.run_path(str(apps / "shim" / "site" / "sitecustomize.py"))
    for path in (apps / "bert_popxl", apps / "deps"):
        sys.path.insert(0, str(path))
    import popxl
    import popxl_addons as addons
    from config import BertConfig
    from modelling.attention import SelfAttention
    from modelling.bert_model import BertLayer
    from modelling.feed_forward import FeedForward
    from popxl_addons.optimizers.adam import AdamOptimizerStep

    return dict(popxl=popxl, addons=addons, BertConfig=BertConfig, BertLayer=BertLayer, SelfAttention=SelfAttention,
                FeedForward=FeedForward, AdamOptimizerStep=AdamOptimizerStep)


def app_config(app: dict[str, Any], batch: int) -> Any:
    config = app["BertConfig"]()
    config.model.hidden_size, config.model.sequence_length = HIDDEN, SEQUENCE
    config.model.attention.heads = HEADS
    config.model.eval = True  # no dropout (the eager layer has none either)
    config.model.dtype = app["popxl"].float32
    config.execution.micro_batch_size = batch
    return config


def requires_weight_decay(name: str) -> bool:
    """The application's rule: no weight decay on layer norms and biases."""
    return not any(k in name for k in ("norm", "bias"))


# -- data --------------------------------------------------------------------------------------
def make_data(batch: int, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``steps`` of (x (batch*128, 768), mask (batch, 128) of 1 (keep) and 0 (pad), dy like x)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, SEQUENCE)
    mask[0, SEQUENCE - 32:] = 0
    return [(torch.rand(batch * SEQUENCE, HIDDEN, generator=gen), mask.clone(),
             torch.randn(batch * SEQUENCE, HIDDEN, generator=gen)) for _ in range(steps)]


# -- eager ---------------------------------------------------------------------------------------
class Eager:
    """Hugging Face's ``BertLayer`` and ``torch.optim.AdamW``, one step per call."""

    def __init__(self, batch: int):
        import transformers
        from transformers.models.bert.modeling_bert import BertLayer

        torch.manual_seed(42)
        # the application's layer: GELU's tanh form (PopXL's gelu), layer norms with popxl_addons' eps 1e-5
        config = transformers.BertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=4 * HIDDEN,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                         hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-5,
                                         attn_implementation="eager")
        self.layer, self.batch = BertLayer(config).eval(), batch
        decay = [p for n, p in self.layer.named_parameters() if requires_weight_decay(n.lower())]
        other = [p for n, p in self.layer.named_parameters() if not requires_weight_decay(n.lower())]
        self.opt = torch.optim.AdamW([dict(params=decay, weight_decay=WEIGHT_DECAY),
                                      dict(params=other, weight_decay=0.0)], lr=LR, eps=EPS)
        self.dx: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, dy: torch.Tensor) -> None:
        x = x.view(self.batch, SEQUENCE, HIDDEN).requires_grad_(True)
        additive = ((mask - 1) * 1000.0).view(self.batch, 1, 1, SEQUENCE)  # the application's mask
        self.opt.zero_grad()
        out = self.layer(x, additive)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dy.view_as(out))
        self.opt.step()
        self.dx = x.grad


# -- ipuxl: the application's layer --------------------------------------------------------------
class AppLayer:
    """The application's ``BertLayer`` with its gradient and optimiser graphs in one program."""

    def __init__(self, app: dict[str, Any], batch: int, steps: int, eager: Eager):
        popxl, addons = app["popxl"], app["addons"]
        ops, named_tensors = popxl.ops, addons.NamedTensors
        self.popxl, config = popxl, app_config(app, batch)
        ir = popxl.Ir()
        ir.num_host_transfers = steps
        with ir.main_graph:
            self.x_stream = popxl.h2d_stream((batch * SEQUENCE, HIDDEN), popxl.float32, "x")
            self.mask_stream = popxl.h2d_stream((batch, SEQUENCE), popxl.float32, "mask")
            self.dy_stream = popxl.h2d_stream((batch * SEQUENCE, HIDDEN), popxl.float32, "dy")
            self.dx_stream = popxl.d2h_stream((batch * SEQUENCE, HIDDEN), popxl.float32, "dx")
            facts, fwd = app["BertLayer"](config).create_graph(self.x_stream.spec, self.mask_stream.spec)
            grad = addons.autodiff(fwd, grads_required=[fwd.graph.inputs[0], *fwd.args.tensors])
            self.variables = facts.init("layer")
            optimizer, optim = app["AdamOptimizerStep"](cache=True), {}
            for name, var in self.variables.to_dict().items():
                args, graph = optimizer.create_graph(
                    var.spec, var.spec, lr=popxl.TensorSpec((), popxl.float32),
                    weight_decay=WEIGHT_DECAY if requires_weight_decay(name) else 0.0, beta1=0.9, beta2=0.999,
                    eps=EPS, bias_correction=True, first_order_dtype=popxl.float32)
                optim[name] = (graph, args.init(f"optim.{name}"))
            lr = popxl.variable(np.array(LR, np.float32), popxl.float32, name="lr")
            state = {"lr": lr, **{f"layer.{k}": v for k, v in self.variables.to_dict().items()},
                     **{f"optim.{n}.{k}": v for n, (_, s) in optim.items() for k, v in s.to_dict().items()}}

            def step(*tensors: Any) -> None:
                """One training step: the device loop's body (PopXL's ``ops.repeat``)."""
                t = dict(zip(state, tensors))
                with popxl.in_sequence():
                    x, mask, dy = (ops.host_load(s) for s in (self.x_stream, self.mask_stream, self.dy_stream))
                    layer = named_tensors.from_dict({k[6:]: v for k, v in t.items() if k.startswith("layer.")})
                    info = fwd.bind(layer).call_with_info(x, mask)
                    grad_info = ops.call_with_info(grad.graph, dy, inputs_dict=grad.grad_graph_info.inputs_dict(info))
                    grads = grad.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(info, grad_info)
                    for name, (graph, _) in optim.items():
                        prefix = f"optim.{name}."
                        moments = named_tensors.from_dict({k[len(prefix):]: v for k, v in t.items()
                                                           if k.startswith(prefix)})
                        var = t[f"layer.{name}"]
                        graph.bind(moments).call(var, grads[var], t["lr"])
                    ops.host_store(self.dx_stream, grads[x])

            body = ir.create_graph(step, *[popxl.TensorByRef(v) for v in state.values()])
            ops.repeat(body, steps, *state.values())
        self.session = popxl.Session(ir, "ipu_hw")
        layer = eager.layer
        weights = {**app["SelfAttention"].hf_mapping(config, self.variables.attention, layer.attention),
                   **app["FeedForward"].hf_mapping(config, self.variables.feed_forward, layer.intermediate,
                                                  layer.output)}
        self.session.write_variables_data(weights)
        self.session.__enter__()
        self.dx: np.ndarray | None = None

    def run(self, data: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """One run: one step per element of ``data`` (``num_host_transfers`` of them)."""
        x, mask, dy = (torch.stack(t) for t in zip(*data))
        out = self.session.run({self.x_stream: x, self.mask_stream: mask, self.dy_stream: dy})
        self.dx = out[self.dx_stream][-1]

    def hf_weights(self, app: dict[str, Any], eager: Eager) -> dict[str, np.ndarray]:
        """The layer's weights in Hugging Face's names and layouts."""
        values = self.session.get_tensors_data(self.variables.tensors)
        named = {name: values[t] for name, t in self.variables.to_dict().items()}
        qkv_w, qkv_b = named["attention.heads.qkv.weight"], named["attention.heads.qkv.bias"]
        out = {}
        for i, part in enumerate(("query", "key", "value")):
            out[f"attention.self.{part}.weight"] = qkv_w[:, i * HIDDEN:(i + 1) * HIDDEN].T
            out[f"attention.self.{part}.bias"] = qkv_b[i * HIDDEN:(i + 1) * HIDDEN]
        pairs = {"attention.output.dense": "attention.output", "attention.output.LayerNorm": "attention.norm",
                 "intermediate.dense": "feed_forward.intermediate", "output.dense": "feed_forward.output",
                 "output.LayerNorm": "feed_forward.norm"}
        for hf, ours in pairs.items():
            w = named[f"{ours}.weight"]
            out[f"{hf}.weight"] = w.T if w.ndim == 2 else w
            out[f"{hf}.bias"] = named[f"{ours}.bias"]
        return out


def check(app: dict[str, Any], batch: int, steps: int) -> float:
    """Train ``steps`` steps on each side from the same weights: the largest relative
    distance between the two sides' weight updates (``update_distance``); raises when it
    exceeds ``UPDATE_TOL`` or the last input gradients differ."""
    eager = Eager(batch)
    ipu = AppLayer(app, batch, steps, eager)
    before = {n: p.detach().clone() for n, p in eager.layer.named_parameters()}
    data = make_data(batch, steps, seed=123)
    ipu.run(data)
    for x, mask, dy in data:
        eager(x, mask, dy)
    ours = {n: torch.from_numpy(np.ascontiguousarray(w)) for n, w in ipu.hf_weights(app, eager).items()}
    worst, where = 0.0, ""
    for name, p in eager.layer.named_parameters():
        if name == "attention.self.key.bias":
            continue
        err = update_distance(ours[name] - before[name], p.detach() - before[name])
        worst, where = max((worst, where), (err, name))
    if worst > UPDATE_TOL:
        raise AssertionError(f"the weight updates differ from eager's: {where} by {worst:.2e} (relative L2)")
    assert eager.dx is not None and ipu.dx is not None
    torch.testing.assert_close(torch.from_numpy(ipu.dx).view_as(eager.dx), eager.dx, **TOL)
    print(f"after {steps} steps: weight updates within {worst:.1e} of eager's (relative L2, worst {where}), "
          "last input gradient equal")
    return worst


def update_distance(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """``||ours - reference|| / ||reference||`` of two weight updates."""
    return float((ours.double() - reference.double()).norm() / reference.double().norm())


def timings(run_ipu: Callable[[], None], run_eager: Callable[[], None], repeats: int) -> tuple[float, float]:
    def timed(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    timed(run_ipu), timed(run_eager)
    t_ipu, t_eager = [], []
    for r in range(repeats):
        for fn, out in [(run_ipu, t_ipu), (run_eager, t_eager)][::1 if r % 2 == 0 else -1]:
            out.append(timed(fn))
    return statistics.median(t_ipu), statistics.median(t_eager)


def main(argv: list[str] | None = None) -> tuple[float, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="micro-batch (sequences of 128 tokens)")
    parser.add_argument("--steps", type=int, default=8, help="steps per timing (one Session.run)")
    parser.add_argument("--check-steps", type=int, default=3, help="steps trained by the check")
    parser.add_argument("--repeats", type=int, default=7, help="timings per side (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave)")
    parser.add_argument("--apps", type=Path, default=DEFAULT_APPS, help="the PopXL applications' folder")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 repeats of 2 steps")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.steps = 2, 2
    if opts.threads:
        torch.set_num_threads(opts.threads)
    app = load_app(opts.apps)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, BERT-base layer, micro-batch "
          f"{opts.batch} x {SEQUENCE} tokens, AdamW, repeats {opts.repeats}, steps/timing {opts.steps}")
    check(app, opts.batch, opts.check_steps)
    eager = Eager(opts.batch)
    ipu = AppLayer(app, opts.batch, opts.steps, eager)
    data = make_data(opts.batch, opts.steps)

    def run_eager() -> None:
        for x, mask, dy in data:
            eager(x, mask, dy)

    t_ipu, t_eager = timings(lambda: ipu.run(data), run_eager, opts.repeats)
    ipu_ms, eager_ms = t_ipu / opts.steps * 1e3, t_eager / opts.steps * 1e3
    print(f"{'ms/step: eager':>15} {'ipuxl':>8} {'eager/ipuxl':>12}\n{eager_ms:>15.2f} {ipu_ms:>8.2f} "
          f"{eager_ms / ipu_ms:>12.3f}")
    return eager_ms, ipu_ms


if __name__ == "__main__":
    main()
