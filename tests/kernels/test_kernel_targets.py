"""Every Python function an op records as an fx node target, and every one the device's
rewrites put in, lives in ``ipuxl.kernels`` (``ops/X`` builds nodes that call
``kernels/Y`` functions; ``ops`` modules define no kernels of their own).

Checked here on the IR and the generated programs of a program that calls every op with
a kernel of its own (a walk over real targets). The same rule on the source (no module
that builds nodes defines a function over torch tensors that it passes to another call,
such as ``emit``) is one of the walls of ``tests/test_layering.py``.
"""
from __future__ import annotations

import types

import numpy as np
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl.dtypes import to_numpy_dtype

#: the kernel modules the program below must reach, so the walk is not vacuous
KERNEL_MODULES = {"conv", "pool", "debug", "elementwise", "indexing", "ipu_copy", "nn", "reduce", "shape", "vision",
                  "random", "var_updates", "collectives"}


def _variable(data, dtype=ipuxl.float32, name=None):
    return ipuxl.variable(np.asarray(data, dtype=to_numpy_dtype(dtype)), dtype, name=name)


def _program() -> tuple[ipuxl.Ir, list[ipuxl.Tensor]]:
    """One call of each op whose node calls a kernel of ipuxl's (not a torch function)."""
    ir = ipuxl.Ir()
    rng = np.random.default_rng(0)
    with ir.main_graph:
        x = _variable(rng.standard_normal((2, 3, 6, 6)), name="x")
        w = _variable(rng.standard_normal((4, 3, 3, 3)), name="w")
        wt = _variable(rng.standard_normal((3, 2, 3, 3)), name="wt")
        m = _variable(rng.standard_normal((3, 4)), name="m")
        v = _variable(rng.standard_normal((4,)), name="v")
        c = _variable(np.ones((3,)), name="c")
        index = _variable([1, 0], ipuxl.int32, name="index")
        labels = _variable([1, 2, 0], ipuxl.int32, name="labels")
        positions = _variable(rng.integers(0, 3, (3, 4)), ipuxl.int32, name="positions")
        seed = _variable([1, 2], ipuxl.uint32, name="seed")
        rois = _variable([[0.0, 0.0, 3.0, 3.0]], name="rois")
        batch = _variable([0], ipuxl.int32, name="batch")
        probs = ops.softmax(m, 1)
        outs = [
            ops.conv(x, w), ops.conv_transpose(x, wt), ops.max_pool(x, (2, 2)), ops.average_pool(x, (2, 2)),
            ops.init((2,), ipuxl.float32), ops.print_tensor(v),
            ops.dynamic_slice(m, index, [0, 1], [1, 2], False),
            ops.dynamic_update(m, index, ops.dynamic_slice(m, index, [0, 1], [1, 2], False), [0, 1], [1, 2], False),
            ops.scatter(m, positions, m, 0), ops.scatter_reduce(m, labels, "sum", axis_size=3),
            *ops.topk(v, 2, 0, True, True), ops.histogram(v, [0.0], False), ops.ipu_copy(v, 1, source=0),
            ops.nll_loss(probs, labels), *ops.nll_loss_with_softmax_grad(probs, labels),
            ops.batch_norm_inference(x, c, c, c, c),
            ops.prod(m), ops.sumsquare(m), ops.argmax(m), ops.argmin(m), ops.lamb_square(m), ops.logsum(m, 1),
            ops.median(m), ops.cumsum(m),
            ops.slice(m, [3], [None], [-1], [1]), ops.subsample(m, [1, 2]), ops.gather(m, index),
            ops.gather(m, index, zero_OOR=True), ops.onehot(labels, 4),
            ops.interpolate(x, (1.0, 1.0, 2.0, 2.0)), ops.roi_align(x, rois, batch, (2, 2), 1.0, 1),
            ops.increment_mod(m, 1, 3), ops.scaled_add(m, m, 2.0, 3.0), ops.dropout(v, seed, 0.5),
            ops.collectives.replicated_all_reduce(v),
        ]
        for in_place in (ops.gelu_, ops.geluerf_, ops.swish_):
            outs.append(in_place(_variable(rng.standard_normal((4,)))))
        outs.append(ops.increment_mod_(_variable(np.zeros((4,))), 1, 3))
        outs.append(ops.scaled_add_(_variable(np.zeros((4,))), v, 2.0, 3.0))
        outs.append(ops.dynamic_update_(_variable(np.zeros((3, 4))), index, m[0:1, 0:2], [0, 1], [1, 2], False))
        outs.append(ops.var_updates.accumulate_(_variable(np.zeros((4,))), v, 0.5))
    return ir, outs


def _ipuxl_functions(nodes) -> set[types.FunctionType]:
    return {n.target for n in nodes if n.op == "call_function" and isinstance(n.target, types.FunctionType)
            and n.target.__module__.startswith("ipuxl")}


def test_ops_record_only_kernels_of_ipuxl_kernels():
    ir, _ = _program()
    targets = _ipuxl_functions(n for g in ir.graphs for n in g.fx.nodes)
    outside = sorted(f"{f.__module__}.{f.__qualname__}" for f in targets
                     if not f.__module__.startswith("ipuxl.kernels."))
    assert outside == []
    assert {f.__module__.removeprefix("ipuxl.kernels.") for f in targets} >= KERNEL_MODULES


def test_generated_programs_call_only_kernels_of_ipuxl_kernels():
    """The compiled code of the program above and of a captured CNN's training step (whose
    rewrites put in ``kernels.conv`` and ``kernels.pool``)."""
    ir, _ = _program()
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, data, target):
            out = self.net(data)
            return out, torch.nn.functional.cross_entropy(out, target)

    net = WithLoss()
    net(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))  # materialise the lazy layer
    training = ipuxl.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    training(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))
    modules = []
    for session in (ipuxl.Session(ir, "cpu"), training.session):
        modules.extend(session.programs)
        modules.extend(c.module for c in map(session.compiled_graph, session.ir.graphs) if c is not None)
    targets = _ipuxl_functions(n for m in modules for n in m.graph.nodes)
    outside = sorted(f"{f.__module__}.{f.__qualname__}" for f in targets  # ipuxl.compiled: calls of compiled graphs
                     if not f.__module__.startswith(("ipuxl.kernels.", "ipuxl.compiled")))
    assert outside == []
    names = {f"{f.__module__}.{f.__name__}" for f in targets}
    assert {"ipuxl.kernels.conv.convolution_backward", "ipuxl.kernels.pool.max_pool2d_with_indices"} <= names
