"""Cross-entropy's gradient in one kernel, over the log-softmax output when it is free.

Rewrites: ``_log_softmax_backward_data(nll_loss_backward(g, lp, t, w, r, ii, tw), lp, d, dt)``
where the ``nll_loss_backward`` has no other reader, ``lp`` is 2-D float32 or float64
(rows, classes) of at least ``MIN_BYTES``, ``d`` is its class dimension (1 or -1) and
``dt`` its dtype, becomes
``kernels.losses.log_softmax_nll_grad(lp, g, t, w, r, ii, tw, in_place)``: no zeros of
the logits' size, no second logits-sized intermediate. A language model's head with a
vocabulary of tens of thousands computes and keeps two tensors of the logits' size fewer.

``in_place`` when ``lp`` is the result of ``_log_softmax`` and every other reader of it
comes before the gradient and is an aten op returning new tensors (the forward's
``nll_loss_forward``; not a view, which a later node could read): the gradient is then
written over the log-probabilities, which nothing reads afterwards.

Preconditions: a lowered fx graph, dead code removed (so "other reader" counts real
readers).

Numerics: aten's products and sums in aten's order (``kernels.losses``); ``exp`` is
torch's elementwise kernel, which differs from the faster one inside aten's log-softmax
backward in the last bit of some elements. Hence ``MIN_BYTES``: a classifier's small
loss keeps aten's kernels and eager's gradients bit for bit; the rewrite takes the
losses whose intermediates cost memory and time (a language model's head).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ipuxl.device.host_memory import MMAP_THRESHOLD
from ipuxl.device.rewrites._nodes import replace_node
from ipuxl.kernels.losses import REDUCTIONS, log_softmax_nll_grad
from ipuxl.passes.result import PassResult

__all__ = ["fuse_cross_entropy_grads", "MIN_BYTES"]

MIN_BYTES = MMAP_THRESHOLD
"""The smallest log-probabilities rewritten: the memory plan's size (``device.memory_plan``),
from which a result's memory is fresh pages each step."""

_aten = torch.ops.aten
_NLL_GRAD = _aten.nll_loss_backward.default
_LOG_SOFTMAX_GRAD = _aten._log_softmax_backward_data.default
_LOG_SOFTMAX = _aten._log_softmax.default
_NLL_NAMES = ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight")
_LSM_GRAD_NAMES = ("grad_output", "output", "dim", "input_dtype")


def fuse_cross_entropy_grads(graph: fx.Graph) -> PassResult:
    """Replace each log-softmax gradient of an nll gradient (the module docstring's form)
    by ``log_softmax_nll_grad``."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    changed = False
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is _LOG_SOFTMAX_GRAD):
            continue
        nll, lp, dim, dtype = _args(node, _LSM_GRAD_NAMES)
        if not (isinstance(nll, fx.Node) and nll.op == "call_function" and nll.target is _NLL_GRAD
                and list(nll.users) == [node] and isinstance(lp, fx.Node)):
            continue
        g, nll_lp, target, weight, reduction, ignore_index, total_weight = _args(nll, _NLL_NAMES)
        meta = lp.meta.get("val")
        if not (nll_lp is lp and isinstance(meta, torch.Tensor) and meta.dim() == 2 and dim in (1, -1)
                and meta.dtype in (torch.float32, torch.float64) and dtype == meta.dtype
                and meta.numel() * meta.element_size() >= MIN_BYTES
                and reduction in REDUCTIONS and isinstance(ignore_index, int)):
            continue
        in_place = (lp.op == "call_function" and lp.target is _LOG_SOFTMAX
                    and all(order[u] < order[node] and _only_reads(u) for u in lp.users if u not in (nll, node)))
        replace_node(graph, node, log_softmax_nll_grad,
                     (lp, g, target, weight, reduction, ignore_index, total_weight, in_place), {}, dead=(nll,))
        changed = True
    return PassResult(graph, changed)


def _only_reads(node: fx.Node) -> bool:
    """An aten op that returns new tensors (no view of its inputs): once it has run, its
    inputs may be overwritten."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and not target._schema.is_mutable and all(r.alias_info is None for r in target._schema.returns))


def _args(node: fx.Node, names: tuple[str, ...]) -> tuple:
    """A node's arguments by position or by name (None where neither gives one)."""
    return tuple(node.args[i] if i < len(node.args) else node.kwargs.get(n) for i, n in enumerate(names))
