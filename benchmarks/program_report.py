"""The program report of an MLP training program, built without data.

Run:   python benchmarks/program_report.py [--blocks N] [--outlined] [--batch-size B]
                                           [--hidden H]

Prints ``ipuxl.device.report.program_report`` of a popxl.addons-style MLP trained
with SGD (seed 002's 4-layer model by default): per graph how it is compiled, its
code size and call sites, the memory of one IPU and the FLOPs per step. With
``--outlined`` every hidden block calls one shared forward and one shared backward
graph, so the code size stays constant as ``--blocks`` grows.
"""
from __future__ import annotations

import argparse
from functools import partial
from typing import Sequence

import numpy as np

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.device.report import ProgramReport, program_report

# A layer's graphs: its variable factories, its forward graph and its backward graph.
LayerGraphs = tuple[addons.NamedVariableFactories, addons.GraphWithNamedArgs, addons.GraphWithNamedArgs]


class Linear(addons.Module):
    """``x @ weight + bias``, then GELU if ``gelu`` (graphs are named ``Linear_subgraph(k)``)."""

    def __init__(self, out_features: int, gelu: bool = False):
        super().__init__()
        self.out_features, self.gelu = out_features, gelu

    def build(self, x: ipuxl.Tensor) -> ipuxl.Tensor:
        w = self.add_variable_input("weight", partial(np.random.normal, 0, 0.02, (x.shape[-1], self.out_features)),
                                    x.dtype)
        b = self.add_variable_input("bias", partial(np.zeros, self.out_features), x.dtype)
        y = x @ w + b
        return ops.gelu(y) if self.gelu else y


def layer_graphs(layer: Linear, x: ipuxl.Tensor) -> LayerGraphs:
    """The forward graph of ``layer`` for input ``x``, and its backward graph."""
    facts, graph = layer.create_graph(x)
    return facts, graph, addons.autodiff(graph)


def mlp_training_ir(batch_size: int = 8, hidden: int = 512, blocks: int = 2, outlined: bool = False,
                    learning_rate: float = 0.05) -> ipuxl.Ir:
    """A popxl.addons-style MLP trained with SGD, built without data.

    ``Linear(784 -> hidden)``, ``blocks`` hidden blocks ``gelu(Linear(hidden -> hidden))``
    and ``Linear(hidden -> 10)``, cross entropy, backward, in-place SGD updates: one
    training step per ``Session.run`` (``num_host_transfers = 1``).
    With ``blocks=2`` it is seed 002's 4-layer MLP. ``outlined``: the block's forward
    and backward are one graph each, called once per block (their code exists once);
    otherwise every block has its own graphs, each inlined into the main program.
    """
    ir = ipuxl.Ir(replication=1)
    with ir.main_graph:
        image = ops.host_load(ipuxl.h2d_stream((batch_size, 28, 28), ipuxl.float32, "image"))
        labels = ops.host_load(ipuxl.h2d_stream((batch_size,), ipuxl.int32, "labels"), "labels")
        x = image.reshape((batch_size, 28 * 28))
        layers: list[Linear | None] = [Linear(hidden, gelu=True), *[None] * blocks, Linear(10)]
        shared: LayerGraphs | None = None
        saved = []  # (forward call info, backward graph, variables) per layer
        for i, layer in enumerate(layers):
            if layer is not None:
                facts, graph, grad = layer_graphs(layer, x)
            elif outlined:  # a hidden block: the first one's graphs serve them all
                shared = shared or layer_graphs(Linear(hidden, gelu=True), x)
                facts, graph, grad = shared
            else:  # a hidden block with graphs of its own
                facts, graph, grad = layer_graphs(Linear(hidden, gelu=True), x)
            variables = facts.init(f"layer{i}")
            info = graph.bind(variables).call_with_info(x)
            saved.append((info, grad, variables))
            x = info.outputs[0]
        loss, dx = addons.ops.cross_entropy_with_grad(x, labels)
        ops.host_store(ipuxl.d2h_stream(loss.shape, loss.dtype, "loss"), loss)
        for info, grad, variables in reversed(saved):
            bwd_info = grad.call_with_info(dx, args=grad.grad_graph_info.inputs_dict(info))
            grads = grad.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(info, bwd_info)
            for t in variables.tensors:
                ops.scaled_add_(t, grads[t], b=-learning_rate)
            dx = bwd_info.outputs[0]
    return ir


def main(argv: Sequence[str] | None = None) -> ProgramReport:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/program_report.py",
        description="Print the program report of an MLP training program (no data needed).")
    parser.add_argument("--blocks", type=int, default=2, help="hidden blocks (2: seed 002's 4-layer MLP)")
    parser.add_argument("--outlined", action="store_true", help="one forward and one backward graph for all blocks")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    opts = parser.parse_args(argv)
    ir = mlp_training_ir(opts.batch_size, opts.hidden, opts.blocks, opts.outlined)
    report = program_report(ir)
    print(report)
    return report


if __name__ == "__main__":
    main()
