"""The device's compile-time rewrites of lowered graphs: one rewrite per module, run in order.

Every rewrite takes a lowered fx graph (``ipuxl.ir.lower``: calls of single-site graphs
inlined, a meta tensor on each tensor-valued node) and returns
``ipuxl.passes.result.PassResult(graph, modified)``. Each rewrites the graph in place,
so ``graph`` is the one it was given. The session compiles each graph once and runs
``REWRITES`` on it once, in this order, before generating its Python code
(``apply_rewrites``):

1. ``eliminate_dead_code`` (``dead_code``): drop unread pure nodes;
2. ``fuse_embedding_grads`` (``embedding_grads``): an embedding's token gradients added
   into the other gradient of a tied or twice-read table, without the table-sized zeros;
3. ``fuse_cross_entropy_grads`` (``cross_entropy_grads``): the gradient of ``nll_loss``
   of ``log_softmax`` in one kernel, over the log-softmax output when nothing else reads it;
4. ``fuse_matmul_updates`` (``matmul_updates``, after ``inverse_transposes``): a matmul
   gradient into its SGD or momentum update (``addmm_``, ``scaled_addmm_``);
5. ``fuse_sgd_momentum_steps`` (``sgd_momentum_steps``): a momentum update and its weight
   update into one ``sgd_momentum_step_``;
6. ``fuse_adam_steps`` (``adam_steps``): the whole Adam/AdamW steps of a graph's weights into
   torch's multi-tensor fused kernel, one call per group of shared hyperparameters;
7. ``fuse_adam_updates`` (``adam_updates``): the remaining Adam update terms into their
   updates (``addcdiv_``);
8. ``call_random_ops_directly`` (``random_calls``): the seeded random ops without the
   custom-op dispatch;
9. ``select_kernels`` (``kernel_choice``): faster kernels with the same results.

The order matters: dead code goes first, so that "the only reader" checks see real
readers; a momentum update of a matmul gradient becomes one GEMM (4) before the
momentum-step fusion (5) could take it; a whole Adam step (6) is preferred to fusing its
update term alone (7). Each module's docstring says what it rewrites, its preconditions
and its numerics.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch.fx as fx

from ipuxl.device.rewrites.adam_steps import fuse_adam_steps
from ipuxl.device.rewrites.adam_updates import fuse_adam_updates
from ipuxl.device.rewrites.cross_entropy_grads import fuse_cross_entropy_grads
from ipuxl.device.rewrites.dead_code import eliminate_dead_code
from ipuxl.device.rewrites.embedding_grads import fuse_embedding_grads
from ipuxl.device.rewrites.inverse_transposes import fold_inverse_transposes
from ipuxl.device.rewrites.kernel_choice import select_kernels
from ipuxl.device.rewrites.matmul_updates import fuse_matmul_updates
from ipuxl.device.rewrites.random_calls import call_random_ops_directly
from ipuxl.device.rewrites.sgd_momentum_steps import fuse_sgd_momentum_steps
from ipuxl.passes.result import PassResult

__all__ = ["Rewrite", "REWRITES", "Rewritten", "apply_rewrites", "eliminate_dead_code", "fuse_embedding_grads",
           "fuse_cross_entropy_grads",
           "fold_inverse_transposes",
           "fuse_matmul_updates", "fuse_sgd_momentum_steps", "fuse_adam_steps", "fuse_adam_updates",
           "call_random_ops_directly", "select_kernels"]

Rewrite = Callable[[fx.Graph], PassResult]

#: the rewrites the session runs on every compiled graph, in this order
REWRITES: tuple[Rewrite, ...] = (
    eliminate_dead_code, fuse_embedding_grads, fuse_cross_entropy_grads, fuse_matmul_updates, fuse_sgd_momentum_steps,
    fuse_adam_steps, fuse_adam_updates, call_random_ops_directly, select_kernels,
)


class Rewritten(NamedTuple):
    """A graph after the rewrites, and the names of those that changed it, in the order they ran."""

    graph: fx.Graph
    applied: tuple[str, ...]


def apply_rewrites(graph: fx.Graph, rewrites: Sequence[Rewrite] = REWRITES) -> Rewritten:
    """Run each of ``rewrites`` once on ``graph``, in order, each on the previous one's result.

    Example:
        >>> graph, applied = apply_rewrites(code)
        >>> applied  # e.g. ('eliminate_dead_code', 'fuse_matmul_updates')
    """
    applied = []
    for rewrite in rewrites:
        result = rewrite(graph)
        graph = result.graph
        if result.modified:
            applied.append(rewrite.__name__)
    return Rewritten(graph, tuple(applied))
