"""Compile-time fusion of gradients and optimiser terms into their in-place updates.

1. An SGD-style update ``ops.scaled_add_(W, dW, b=c)`` of a gradient computed by a
matmul, ``dW = mm(a, g)``, becomes one BLAS call, ``W.addmm_(a, g, alpha=c)``
(``W + c * (a @ g)``): the gradient is never written to memory and read back.
Numerics: the same products and sums; only the final rounding of ``c * (a @ g)``
before the addition may differ in the last bit. With a tensor factor ``c`` (a
learning-rate variable) the smaller operand is scaled first, ``W.addmm_(a * c, g)``:
each product is then rounded once more (a relative difference of about 1e-7 of the
update term). Gradients captured from modules (``make_fx``) reach the update as
``t(t(mm(a, g)))`` (autograd keeps ``W.t()``'s layout for the gradient of ``W.t()``,
then transposes it back); such inverse pairs of transposes and permutes are folded
first (``fold_inverse_transposes``), so the matmul is seen.

2. An Adam-style update ``ops.scaled_add_(W, adam_updater(m, v, ...), b=c)`` without
weight decay becomes one ``addcdiv_`` (``var_updates._adam_update_``) when the
updater's result has ``W``'s dtype, so the update term is never materialised.

3. A whole bias-corrected Adam step (both moment updates, ``adam_updater`` and the
update) of float32/float16 tensors of one dtype becomes torch's fused Adam kernel
(``var_updates._fused_adam_step_``) when the moments have no other reader. Its
moment factors are the Python numbers in double precision, not rounded to float32.

4. Kernel choice (``select_kernels``): a CPU max pool with indices of a contiguous
(NCHW) float tensor with 8 or more channels runs torch's channels-last kernel, several
times faster than its NCHW one (which is not vectorised), on a channels-last copy of
the input; the results are copied back to NCHW. Values and indices are the
kernel's own (the same windows scanned in the same order: bit for bit what the NCHW
kernel gives, NaNs and ties included), so everything downstream, the backward's
``max_pool2d_with_indices_backward`` included, is unchanged.

Preconditions: a lowered fx graph (calls of single-site graphs already inlined, so
the gradient's matmul and its update sit in one graph). The matmul's result must
have no other user.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ipuxl.ops.var_updates import (
    _adam_update_, _adam_updater, _fused_adam_step_, _moving_average, _moving_average_square,
)

__all__ = ["fuse_matmul_updates", "fold_inverse_transposes", "fuse_adam_updates", "fuse_adam_steps",
           "call_random_ops_directly", "select_kernels", "max_pool2d_with_indices"]

_MATMULS = (torch.ops.aten.mm.default, torch.mm)
_aten = torch.ops.aten


def fold_inverse_transposes(graph: fx.Graph) -> bool:
    """Replace ``t(t(x))``, ``transpose(transpose(x, i, j), i, j)`` and
    ``permute(permute(x, p), q)`` with ``q`` undoing ``p`` by ``x`` itself in the ops
    that read them; True if any changed.

    Such a pair is a view of ``x`` with ``x``'s own sizes, strides and offset, so
    every reader (in-place writers included) sees the same elements through ``x``.
    Graph outputs keep the view (lowering decided their copies already); the inner
    view is removed when nothing else reads it.
    """
    changed = False
    for node in list(graph.nodes):
        source = _inverse_pair_source(node)
        if source is None:
            continue
        readers = [user for user in node.users if user.op != "output"]
        for user in readers:
            user.replace_input_with(node, source)
        changed = changed or bool(readers)
        inner = node.args[0]
        if not node.users:
            graph.erase_node(node)
            if not inner.users:
                graph.erase_node(inner)
    return changed


def _transpose_permutation(node: Any) -> list[int] | None:
    """The dimension permutation a pure transposing view applies, or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function") or node.meta.get("ipuxl_writes"):
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or node.kwargs:
        return None
    rank = val.dim()
    if node.target is _aten.t.default and len(node.args) == 1:
        return [1, 0] if rank == 2 else list(range(rank))
    if node.target is _aten.transpose.int and len(node.args) == 3:
        i, j = (d % rank if rank else 0 for d in node.args[1:])
        perm = list(range(rank))
        if rank:
            perm[i], perm[j] = perm[j], perm[i]
        return perm
    if node.target is _aten.permute.default and len(node.args) == 2:
        return [d % rank for d in node.args[1]]
    return None


def _inverse_pair_source(node: fx.Node) -> fx.Node | None:
    """``x`` when ``node`` is a transposing view of a transposing view of ``x`` that undoes it."""
    outer = _transpose_permutation(node)
    if outer is None:
        return None
    inner_node = node.args[0]
    inner = _transpose_permutation(inner_node)
    if inner is None or len(inner) != len(outer) or not isinstance(inner_node.args[0], fx.Node):
        return None
    if [inner[d] for d in outer] != list(range(len(outer))):
        return None
    return inner_node.args[0]


def fuse_matmul_updates(graph: fx.Graph) -> bool:
    """Rewrite ``W.add_(mm(a, g), alpha=c)`` as ``W.addmm_(a, g, alpha=c)``, and
    ``W.addcmul_(mm(a, g), s)`` (a tensor factor ``s``, e.g. a learning-rate variable)
    as ``W.addmm_(a, g * s)``, scaling the smaller operand; True if any changed.
    Inverse transpose pairs are folded first (``fold_inverse_transposes``)."""
    changed = fold_inverse_transposes(graph)
    for node in list(graph.nodes):
        grad = _update_term(node, _MATMULS)
        if grad is not None:
            _replace(graph, node, torch.Tensor.addmm_, (node.args[0], *grad.args),
                     {"alpha": node.kwargs.get("alpha", 1)}, dead=(grad,))
            changed = True
            continue
        grad = _scaled_update_term(node)
        if grad is not None:
            a, g = grad.args
            scale_a = _numel(a) < _numel(g)
            with graph.inserting_before(node):
                scaled = graph.call_function(torch.mul, ((a if scale_a else g), node.args[2]))
            scaled.meta["val"] = (a if scale_a else g).meta.get("val")
            # part of the user's update: errors name its op and line (not its writes: it writes nothing)
            scaled.meta.update({k: node.meta[k] for k in ("ipuxl_op", "ipuxl_source") if k in node.meta})
            _replace(graph, node, torch.Tensor.addmm_, (node.args[0], *((scaled, g) if scale_a else (a, scaled))),
                     {}, dead=(grad,))
            changed = True
    return changed


def _scaled_update_term(node: fx.Node) -> fx.Node | None:
    """The matmul ``t`` of ``W.addcmul_(t, s)`` with a 0-dim tensor ``s``, used only there."""
    if not (node.op == "call_function" and node.target is torch.Tensor.addcmul_ and len(node.args) == 3
            and not node.kwargs):
        return None
    term, factor = node.args[1], node.args[2]
    factor_val = factor.meta.get("val") if isinstance(factor, fx.Node) else None
    if (isinstance(term, fx.Node) and term.target in _MATMULS and len(term.users) == 1
            and factor_val is not None and factor_val.dim() == 0):
        return term
    return None


def _numel(node: Any) -> float:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return float("inf") if val is None else val.numel()


def fuse_adam_updates(graph: fx.Graph) -> bool:
    """Rewrite ``W.add_(adam_updater(m, v, None, step, None, b1, b2, eps), alpha=c)`` as one fused update."""
    changed = False
    for node in list(graph.nodes):
        term = _update_term(node, (_adam_updater,))
        if term is None:
            continue
        m, v, _, step, wd, beta1, beta2, eps = term.args
        weight = node.args[0]
        if wd is not None or term.meta["val"].dtype != weight.meta["val"].dtype:
            continue
        _replace(graph, node, _adam_update_, (weight, m, v, step, beta1, beta2, eps, node.kwargs.get("alpha", 1)),
                 {}, dead=(term,))
        changed = True
    return changed


def fuse_adam_steps(graph: fx.Graph) -> bool:
    """Rewrite a whole Adam step of one weight as one fused kernel (see the module docstring)."""
    changed = False
    for node in list(graph.nodes):
        match = _adam_step(node)
        if match is None:
            continue
        term, m_node, v_node = match
        grad, m, v, step = m_node.args[1], m_node.args[0], v_node.args[0], term.args[3]
        lr, beta1, beta2, eps = -node.kwargs.get("alpha", 1), term.args[5], term.args[6], term.args[7]
        _replace(graph, node, _fused_adam_step_, (node.args[0], grad, m, v, step, lr, beta1, beta2, eps), {},
                 dead=(term, v_node, m_node))
        changed = True
    return changed


def _is_update(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.Tensor.add_ and len(node.args) == 2
            and set(node.kwargs) <= {"alpha"})


def _update_term(node: fx.Node, targets: tuple) -> fx.Node | None:
    """The term ``t`` of an update ``W.add_(t, alpha=c)`` when ``t`` is one of ``targets``, used only there."""
    if not _is_update(node):
        return None
    term = node.args[1]
    if isinstance(term, fx.Node) and term.target in targets and len(term.users) == 1:
        return term
    return None


def _replace(graph: fx.Graph, node: fx.Node, target: Any, args: tuple, kwargs: dict,
             dead: tuple[fx.Node, ...]) -> None:
    """Put ``target(*args, **kwargs)`` where update ``node`` was and erase it and the ``dead`` nodes."""
    with graph.inserting_before(node):
        fused = graph.call_function(target, args, kwargs)
    fused.meta.update(node.meta)
    node.replace_all_uses_with(fused)
    for erased in (node, *dead):
        graph.erase_node(erased)


def _adam_step(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(updater, first-moment node, second-moment node) when ``node`` ends a fusable Adam step."""
    term = _update_term(node, (_adam_updater,))
    if term is None:
        return None
    m_node, v_node, w, step, wd, beta1, beta2, eps = term.args
    if w is not None or wd is not None or step is None or not all(
            isinstance(x, (int, float)) for x in (beta1, beta2, eps, node.kwargs.get("alpha", 1))):
        return None
    if not (isinstance(m_node, fx.Node) and m_node.target is _moving_average and m_node.args[2] == beta1
            and isinstance(v_node, fx.Node) and v_node.target is _moving_average_square and v_node.args[2] == beta2
            and m_node.args[1] is v_node.args[1] and len(m_node.users) == 1 and len(v_node.users) == 1
            and len(step.users) == 1):
        return None
    tensors = [node.args[0], m_node.args[1], m_node.args[0], v_node.args[0]]
    dtypes = {t.meta["val"].dtype for t in tensors} | {term.meta["val"].dtype}
    if len(dtypes) != 1 or dtypes & {torch.float64}:
        return None
    # The moments must have no reader besides their update (it now happens at the weight update).
    if len(m_node.args[0].users) != 1 or len(v_node.args[0].users) != 1:
        return None
    return term, m_node, v_node


def call_random_ops_directly(graph: fx.Graph) -> bool:
    """Call the seeded random ops' Python implementations without the custom-op dispatch."""
    from ipuxl.ops.random import DIRECT_CALLS

    return _retarget(graph, DIRECT_CALLS)


def _retarget(graph: fx.Graph, targets: dict) -> bool:
    """Call ``targets[f]`` wherever the graph calls ``f``; True if any changed."""
    changed = False
    for node in graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = targets[node.target]
            changed = True
    return changed


# -- kernel choice ------------------------------------------------------------------------------
_CHANNELS_LAST_POOL_DTYPES = (torch.float32, torch.float64)
_CHANNELS_LAST_POOL_MIN_CHANNELS = 8  # the channels-last kernel vectorises over channels


def max_pool2d_with_indices(x: torch.Tensor, kernel_size: Any, stride: Any = (), padding: Any = 0,
                            dilation: Any = 1, ceil_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.max_pool2d_with_indices`` with the same results (values, indices, strides),
    computed by the channels-last CPU kernel where that is faster (see the module docstring)."""
    if (x.device.type == "cpu" and x.dim() == 4 and x.dtype in _CHANNELS_LAST_POOL_DTYPES
            and x.shape[1] >= _CHANNELS_LAST_POOL_MIN_CHANNELS and x.is_contiguous()):
        out, indices = _aten.max_pool2d_with_indices.default(
            x.contiguous(memory_format=torch.channels_last), kernel_size, stride, padding, dilation, ceil_mode)
        return out.contiguous(), indices.contiguous()
    return _aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding, dilation, ceil_mode)


max_pool2d_with_indices._ipuxl_pure = True  # type: ignore[attr-defined]  # for device.dce
_KERNELS = {_aten.max_pool2d_with_indices.default: max_pool2d_with_indices}


def select_kernels(graph: fx.Graph) -> bool:
    """Replace ops by implementations with the same results that run faster (the module
    docstring, point 4); True if any changed."""
    return _retarget(graph, _KERNELS)
