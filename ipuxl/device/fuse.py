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
weight decay becomes one ``addcdiv_`` (``kernels.var_updates.adam_update_``) when the
updater's result has ``W``'s dtype, so the update term is never materialised.

3. A whole bias-corrected Adam step (both moment updates, ``adam_updater`` and the
update) of float32/float16 tensors of one dtype becomes torch's fused Adam kernel
(``kernels.var_updates.fused_adam_step_``) when the moments have no other reader. Its
moment factors are the Python numbers in double precision, not rounded to float32.

4. Kernel choice (``select_kernels``): a CPU max pool with indices of a contiguous
(NCHW) float tensor with 8 or more channels runs torch's channels-last kernel, several
times faster than its NCHW one (which is not vectorised), on a channels-last copy of
the input; the results are copied back to NCHW. Values and indices are the
kernel's own (the same windows scanned in the same order: bit for bit what the NCHW
kernel gives, NaNs and ties included), so everything downstream, the backward's
``max_pool2d_with_indices_backward`` included, is unchanged.

5. SGD momentum (``fuse_sgd_momentum_steps``, and in ``fuse_matmul_updates``): a momentum
update ``scaled_add_(buf, mm(a, g), m, 1)`` of a matmul gradient becomes one GEMM into the
buffer (``kernels.var_updates.scaled_addmm_``); any other momentum update followed by its
weight update becomes ``kernels.var_updates.sgd_momentum_step_`` (torch's fused SGD kernel
on large CPU tensors, bit for bit the unfused steps).

6. Convolution gradients (``select_kernels``): ``convolution_backward`` computes the
gradients oneDNN is slow at for small images (small pointwise convolutions, small-output
and large-kernel depthwise weight gradients) with GEMMs or a convolution.

Preconditions: a lowered fx graph (calls of single-site graphs already inlined, so
the gradient's matmul and its update sit in one graph). The matmul's result must
have no other user.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, cast

import torch
import torch.fx as fx

from ipuxl.device.dce import pure
from ipuxl.ir.aliases import writes
from ipuxl.ir.meta import OP, SOURCE
from ipuxl.kernels import var_updates
from ipuxl.kernels.random import DIRECT_CALLS
from ipuxl.ops.elementwise import SCALED_ADD_KERNEL

__all__ = ["fuse_matmul_updates", "fold_inverse_transposes", "fuse_adam_updates", "fuse_adam_steps",
           "call_random_ops_directly", "select_kernels", "max_pool2d_with_indices", "convolution_backward",
           "fuse_sgd_momentum_steps"]

_MATMULS = (torch.ops.aten.mm.default, torch.mm)
_aten = torch.ops.aten


# -- typed access to fx nodes ---------------------------------------------------------------------
def _input(node: fx.Node, i: int) -> fx.Node | None:
    """Argument ``i`` of ``node`` when it is a node (None when it is a constant or missing)."""
    arg = node.args[i] if i < len(node.args) else None
    return arg if isinstance(arg, fx.Node) else None


def _val(node: fx.Node) -> torch.Tensor:
    """The meta tensor of ``node``'s result (lowering keeps one on every tensor-valued node)."""
    return cast(torch.Tensor, node.meta["val"])


def _ints(values: Sequence[Any]) -> list[int] | None:
    """``values`` as ints, or None when one of them is not an int."""
    return list(values) if all(isinstance(v, int) for v in values) else None


def _alpha(node: fx.Node) -> Any:
    """The ``alpha`` of an update ``W.add_(t, alpha=c)`` (1 when not given)."""
    return node.kwargs.get("alpha", 1)


# -- 1. matmul gradients into their updates ---------------------------------------------------------
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
        pair = _inverse_pair(node)
        if pair is None:
            continue
        inner, source = pair
        readers = [user for user in node.users if user.op != "output"]
        for user in readers:
            user.replace_input_with(node, source)
        changed = changed or bool(readers)
        if not node.users:
            graph.erase_node(node)
            if not inner.users:
                graph.erase_node(inner)
    return changed


def _transpose_permutation(node: fx.Node) -> list[int] | None:
    """The dimension permutation a pure transposing view applies, or None."""
    if node.op != "call_function" or writes(node) or node.kwargs:
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    rank = val.dim()
    if node.target is _aten.t.default and len(node.args) == 1:
        return [1, 0] if rank == 2 else list(range(rank))
    if node.target is _aten.transpose.int and len(node.args) == 3:
        dims = _ints(node.args[1:])
        if dims is None:
            return None
        i, j = (d % rank if rank else 0 for d in dims)
        perm = list(range(rank))
        if rank:
            perm[i], perm[j] = perm[j], perm[i]
        return perm
    if node.target is _aten.permute.default and len(node.args) == 2:
        order = _ints(cast(Sequence[Any], node.args[1]))
        return None if order is None else [d % rank for d in order]
    return None


def _inverse_pair(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(inner, x)`` when ``node`` is a transposing view of a transposing view ``inner`` of
    ``x`` that undoes it."""
    outer = _transpose_permutation(node)
    inner_node = _input(node, 0)
    if outer is None or inner_node is None:
        return None
    inner = _transpose_permutation(inner_node)
    source = _input(inner_node, 0)
    if inner is None or len(inner) != len(outer) or source is None:
        return None
    if [inner[d] for d in outer] != list(range(len(outer))):
        return None
    return inner_node, source


def fuse_matmul_updates(graph: fx.Graph) -> bool:
    """Rewrite ``W.add_(mm(a, g), alpha=c)`` as ``W.addmm_(a, g, alpha=c)``, and
    ``W.addcmul_(mm(a, g), s)`` (a tensor factor ``s``, e.g. a learning-rate variable)
    as ``W.addmm_(a, g * s)``, scaling the smaller operand; True if any changed.
    Inverse transpose pairs are folded first (``fold_inverse_transposes``)."""
    changed = fold_inverse_transposes(graph)
    for node in list(graph.nodes):
        grad = _update_term(node, _MATMULS)
        if grad is not None:
            _replace(graph, node, torch.Tensor.addmm_, (node.args[0], *grad.args), {"alpha": _alpha(node)},
                     dead=(grad,))
            changed = True
        elif _fuse_scaled_matmul_update(graph, node) or _fuse_momentum_matmul_update(graph, node):
            changed = True
    return changed


def _fuse_momentum_matmul_update(graph: fx.Graph, node: fx.Node) -> bool:
    """``scaled_add_(buf, mm(a, g), m, c)`` (a momentum update, ``c`` a number) ->
    ``scaled_addmm_(buf, a, g, m, c)``, one GEMM into ``buf``; True if done."""
    if node.op != "call_function" or node.target is not SCALED_ADD_KERNEL or len(node.args) != 4:
        return False
    term, factor, alpha = node.args[1], node.args[2], node.args[3]
    if not (isinstance(term, fx.Node) and term.target in _MATMULS and len(term.users) == 1
            and isinstance(alpha, (int, float)) and _is_scalar(factor)):
        return False
    _replace(graph, node, var_updates.scaled_addmm_, (node.args[0], *term.args, factor, alpha), {}, dead=(term,))
    return True


def fuse_sgd_momentum_steps(graph: fx.Graph) -> bool:
    """``scaled_add_(buf, g, m, 1)`` then ``W.addcmul_(buf, -lr)`` (an SGD momentum step;
    ``m`` and ``-lr`` scalars) -> one ``sgd_momentum_step_(W, buf, g, m, -lr)`` where the
    weight update was, when nothing between the two reads or writes ``buf``, ``g`` or ``W``;
    True if any changed."""
    changed = False
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is SCALED_ADD_KERNEL and len(node.args) == 4
                and node.args[3] == 1 and _is_scalar(node.args[2]) and len(node.users) == 1):
            continue
        update = next(iter(node.users))
        if not (update.target is torch.Tensor.addcmul_ and len(update.args) == 3 and not update.kwargs
                and update.args[1] is node and _is_scalar(update.args[2])):
            continue
        buf, grad, weight = node.args[0], node.args[1], update.args[0]
        if not all(isinstance(t, fx.Node) for t in (buf, grad, weight)) or _touched_between(node, update,
                                                                                              {buf, grad, weight}):
            continue
        _replace(graph, update, var_updates.sgd_momentum_step_, (weight, buf, grad, node.args[2], update.args[2]), {},
                 dead=(node,))
        changed = True
    return changed


def _touched_between(first: fx.Node, last: fx.Node, tensors: set[Any]) -> bool:
    """Whether a node strictly between ``first`` and ``last`` takes one of ``tensors`` as an argument."""
    node = first.next
    while node is not last:
        if any(arg in tensors for arg in node.all_input_nodes):
            return True
        node = node.next
    return False


def _is_scalar(value: Any) -> bool:
    """A Python number or a node of a 0-dimensional tensor."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    meta = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(meta, torch.Tensor) and meta.dim() == 0


def _fuse_scaled_matmul_update(graph: fx.Graph, node: fx.Node) -> bool:
    """``W.addcmul_(mm(a, g), s)`` -> ``W.addmm_(a * s, g)`` or ``W.addmm_(a, g * s)``; True if done."""
    match = _scaled_update_term(node)
    if match is None:
        return False
    grad, a, g, factor = match
    scale_a = _numel(a) < _numel(g)
    with graph.inserting_before(node):
        scaled = graph.call_function(torch.mul, ((a if scale_a else g), factor))
    scaled.meta["val"] = (a if scale_a else g).meta.get("val")
    # part of the user's update: errors name its op and line (not its writes: it writes nothing)
    scaled.meta.update({k: node.meta[k] for k in (OP, SOURCE) if k in node.meta})
    _replace(graph, node, torch.Tensor.addmm_, (node.args[0], *((scaled, g) if scale_a else (a, scaled))), {},
             dead=(grad,))
    return True


def _scaled_update_term(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """``(t, a, g, s)`` of ``W.addcmul_(t, s)`` with ``t = mm(a, g)`` used only there and a
    0-dim tensor ``s``."""
    if not (node.op == "call_function" and node.target is torch.Tensor.addcmul_ and len(node.args) == 3
            and not node.kwargs):
        return None
    term, factor = _input(node, 1), _input(node, 2)
    if term is None or factor is None or term.target not in _MATMULS or len(term.users) != 1:
        return None
    a, g = _input(term, 0), _input(term, 1)
    factor_val = factor.meta.get("val")
    if a is None or g is None or factor_val is None or factor_val.dim() != 0:
        return None
    return term, a, g, factor


def _numel(node: fx.Node) -> float:
    val = node.meta.get("val")
    return float("inf") if val is None else val.numel()


# -- 2. and 3. Adam ---------------------------------------------------------------------------------
def fuse_adam_updates(graph: fx.Graph) -> bool:
    """Rewrite ``W.add_(adam_updater(m, v, None, step, None, b1, b2, eps), alpha=c)`` as one fused update."""
    changed = False
    for node in list(graph.nodes):
        term = _update_term(node, (var_updates.adam_updater,))
        weight = _input(node, 0)
        if term is None or weight is None:
            continue
        m, v, _, step, wd, beta1, beta2, eps = term.args
        if wd is not None or _val(term).dtype != _val(weight).dtype:
            continue
        _replace(graph, node, var_updates.adam_update_, (weight, m, v, step, beta1, beta2, eps, _alpha(node)), {},
                 dead=(term,))
        changed = True
    return changed


class _AdamStep(NamedTuple):
    """The nodes of one weight's fusable Adam step, ended by the weight update."""

    updater: fx.Node
    first_moment: fx.Node  # moving_average_(m, grad, beta1)
    second_moment: fx.Node  # moving_average_square_(v, grad, beta2)
    step: fx.Node


def fuse_adam_steps(graph: fx.Graph) -> bool:
    """Rewrite a whole Adam step of one weight as one fused kernel (see the module docstring)."""
    changed = False
    for node in list(graph.nodes):
        match = _adam_step(node)
        if match is None:
            continue
        term, m_node, v_node = match.updater, match.first_moment, match.second_moment
        lr, beta1, beta2, eps = -_alpha(node), term.args[5], term.args[6], term.args[7]
        args = (node.args[0], m_node.args[1], m_node.args[0], v_node.args[0], match.step, lr, beta1, beta2, eps)
        _replace(graph, node, var_updates.fused_adam_step_, args, {}, dead=(term, v_node, m_node))
        changed = True
    return changed


def _is_update(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.Tensor.add_ and len(node.args) == 2
            and set(node.kwargs) <= {"alpha"})


def _update_term(node: fx.Node, targets: tuple[Callable[..., Any], ...]) -> fx.Node | None:
    """The term ``t`` of an update ``W.add_(t, alpha=c)`` when ``t`` is one of ``targets``, used only there."""
    if not _is_update(node):
        return None
    term = _input(node, 1)
    if term is not None and term.target in targets and len(term.users) == 1:
        return term
    return None


def _replace(graph: fx.Graph, node: fx.Node, target: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], dead: tuple[fx.Node, ...]) -> None:
    """Put ``target(*args, **kwargs)`` where update ``node`` was and erase it and the ``dead`` nodes."""
    with graph.inserting_before(node):
        fused = graph.call_function(target, args, kwargs)
    fused.meta.update(node.meta)
    node.replace_all_uses_with(fused)
    for erased in (node, *dead):
        graph.erase_node(erased)


def _adam_step(node: fx.Node) -> _AdamStep | None:
    """The Adam step ``node`` ends, when it can be fused: bias-corrected, no weight decay,
    number factors, moments updated just before from one gradient and read by nothing
    else, all tensors of one dtype other than float64."""
    term = _update_term(node, (var_updates.adam_updater,))
    if term is None:
        return None
    _, _, w, _, wd, beta1, beta2, eps = term.args
    step = _input(term, 3)
    if w is not None or wd is not None or step is None or len(step.users) != 1 or not all(
            isinstance(x, (int, float)) for x in (beta1, beta2, eps, _alpha(node))):
        return None
    m_node = _moment_update(term, 0, var_updates.moving_average_, beta1)
    v_node = _moment_update(term, 1, var_updates.moving_average_square_, beta2)
    if m_node is None or v_node is None or m_node.args[1] is not v_node.args[1]:
        return None
    tensors = [node.args[0], m_node.args[1], m_node.args[0], v_node.args[0]]
    if not all(isinstance(t, fx.Node) for t in tensors):
        return None
    dtypes = {_val(t).dtype for t in cast(list[fx.Node], tensors)} | {_val(term).dtype}
    if len(dtypes) != 1 or dtypes & {torch.float64}:
        return None
    return _AdamStep(term, m_node, v_node, step)


def _moment_update(term: fx.Node, i: int, kernel: Callable[..., Any], beta: Any) -> fx.Node | None:
    """Argument ``i`` of the updater ``term`` when it is ``kernel(moment, grad, beta)``, the
    only reader of its result, and the moment has no other reader."""
    update = _input(term, i)
    if update is None or update.target is not kernel or update.args[2] != beta or len(update.users) != 1:
        return None
    moment = _input(update, 0)
    return update if moment is not None and len(moment.users) == 1 else None


# -- random ops and kernel choice ---------------------------------------------------------------------
def call_random_ops_directly(graph: fx.Graph) -> bool:
    """Call the seeded random ops' Python implementations without the custom-op dispatch."""
    return _retarget(graph, DIRECT_CALLS)


def _retarget(graph: fx.Graph, targets: dict[Any, Callable[..., Any]]) -> bool:
    """Call ``targets[f]`` wherever the graph calls ``f``; True if any changed."""
    changed = False
    for node in graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = targets[node.target]
            changed = True
    return changed


_CHANNELS_LAST_POOL_DTYPES = (torch.float32, torch.float64)
_CHANNELS_LAST_POOL_MIN_CHANNELS = 8  # the channels-last kernel vectorises over channels


@pure
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


#: the weight gradient of a 2-D convolution whose output has at most this many positions over the
#: whole batch (N x Ho x Wo) is one GEMM (see ``convolution_backward``)
GEMM_WEIGHT_GRADIENT_MAX_POSITIONS = 16
#: a pointwise convolution's gradients are GEMMs when out x in channels x output positions is at
#: most this (above it oneDNN's kernels are as fast), NCHW ones only from this many positions
#: and at several threads
POINTWISE_GEMM_MAX_WORK = 4_000_000
POINTWISE_GEMM_MIN_POSITIONS_NCHW = 64
#: the weight gradient of a depthwise 2-D convolution with at least this many taps is a convolution
DEPTHWISE_CONV_WEIGHT_GRADIENT_MIN_TAPS = 25


@pure
def convolution_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias_sizes: Any,
                         stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                         output_padding: Sequence[int], groups: int, output_mask: Sequence[bool]) -> tuple[Any, ...]:
    """``aten.convolution_backward``, with gradients computed another way where oneDNN's
    kernels are slow (CPU, untransposed 2-D convolutions):

    * a small pointwise convolution (``_pointwise_by_gemm``): both gradients as GEMMs;
    * ungrouped, at most ``GEMM_WEIGHT_GRADIENT_MAX_POSITIONS`` output positions in all (the
      last stages of an ImageNet CNN at small images or batches: for 512x512x3x3 at 2x2 and
      batch 4 oneDNN takes ~10x the forward's time): one GEMM, ``grad_output (K, N*L) @
      unfold(input) (N*L, C*kh*kw)``, about the forward's time (1x1 convolutions at one
      thread only from 8 positions, below which oneDNN's is as fast);
    * depthwise with ``DEPTHWISE_CONV_WEIGHT_GRADIENT_MIN_TAPS`` taps or more: one depthwise
      convolution (``_weight_gradient_depthwise``).

    For the last two the input gradient is oneDNN's alone, and always the bias gradient a sum (oneDNN's bias
    gradient without the weight's is slow). Values: the same products, summed in another
    order (float32 rounding, ~1e-7 relative); every other convolution is aten's, bit for bit.
    """
    mask = list(output_mask)
    if not _is_plain_cpu_conv2d(x, transposed):
        return _aten.convolution_backward.default(grad_output, x, weight, bias_sizes, stride, padding, dilation,
                                                  transposed, output_padding, groups, output_mask)
    if _pointwise_by_gemm(grad_output, x, weight, stride, padding, groups):
        return _pointwise_backward(grad_output, x, weight, mask)
    weight_gradient = None
    if mask[1] and _gemm_weight_gradient(grad_output, weight, groups):
        weight_gradient = _weight_gradient_gemm
    elif mask[1] and _depthwise_weight_gradient(x, weight, groups):
        weight_gradient = _weight_gradient_depthwise
    if weight_gradient is None:
        return _aten.convolution_backward.default(grad_output, x, weight, bias_sizes, stride, padding, dilation,
                                                  transposed, output_padding, groups, output_mask)
    grad_input = grad_bias = None
    if mask[0]:
        grad_input = _aten.convolution_backward.default(grad_output, x, weight, bias_sizes, stride, padding,
                                                        dilation, transposed, output_padding, groups,
                                                        [True, False, False])[0]
    if mask[2]:  # oneDNN's bias gradient without the weight's is slow (10 ms for 768 channels at 2x2)
        grad_bias = grad_output.sum((0, 2, 3))
    grad_weight = weight_gradient(grad_output, x, tuple(weight.shape), list(stride), list(padding),
                                  list(dilation)).contiguous(memory_format=_memory_format_of(weight))
    return grad_input, grad_weight, grad_bias


def _pointwise_by_gemm(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                       padding: Sequence[int], groups: int) -> bool:
    """A small pointwise (1x1, stride 1, unpadded, ungrouped) convolution, both tensors
    channels-last, or NCHW at several threads: oneDNN's backward costs up to ~2x two GEMMs there."""
    if tuple(weight.shape[2:]) != (1, 1) or list(stride) != [1, 1] or list(padding) != [0, 0] or groups != 1:
        return False
    positions = grad_output.numel() // grad_output.shape[1]
    if weight.shape[0] * weight.shape[1] * positions > POINTWISE_GEMM_MAX_WORK:
        return False
    if _channels_last(x) and _channels_last(grad_output):
        return True
    # NCHW: only where oneDNN splits the small convolution over threads (at one thread it is faster)
    return (x.is_contiguous() and grad_output.is_contiguous() and positions >= POINTWISE_GEMM_MIN_POSITIONS_NCHW
            and torch.get_num_threads() > 1)


def _channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last)


def _pointwise_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        mask: list[bool]) -> tuple[Any, ...]:
    """A pointwise convolution's gradients as GEMMs: ``dW = g^T x`` and ``dx = g W`` over the
    (batch x position, channel) matrices, in the tensors' own layout (no copies channels-last)."""
    n, k, h, w = grad_output.shape
    c = x.shape[1]
    matrix = weight.reshape(k, c)
    grad_input = grad_weight = grad_bias = None
    if _channels_last(x) and _channels_last(grad_output):
        g2, x2 = grad_output.permute(0, 2, 3, 1).reshape(-1, k), x.permute(0, 2, 3, 1).reshape(-1, c)
        if mask[0]:
            grad_input = torch.mm(g2, matrix).view(n, h, w, c).permute(0, 3, 1, 2)
        if mask[1]:
            grad_weight = torch.mm(g2.t(), x2)
    else:
        g3, x3 = grad_output.reshape(n, k, h * w), x.reshape(n, c, h * w)
        if mask[0]:
            grad_input = torch.matmul(matrix.t(), g3).view(n, c, h, w)
        if mask[1]:
            grad_weight = torch.mm(g3.transpose(0, 1).reshape(k, -1), x3.transpose(1, 2).reshape(-1, c))
    if grad_weight is not None:
        grad_weight = grad_weight.view(weight.shape).contiguous(memory_format=_memory_format_of(weight))
    if mask[2]:
        grad_bias = grad_output.sum((0, 2, 3))
    return grad_input, grad_weight, grad_bias


def _weight_gradient_gemm(grad_output: torch.Tensor, x: torch.Tensor, shape: tuple[int, ...], stride: list[int],
                          padding: list[int], dilation: list[int]) -> torch.Tensor:
    """An ungrouped convolution's weight gradient as one GEMM over the unfolded input."""
    n, k = grad_output.shape[:2]
    kernel = shape[2:]
    if kernel == (1, 1) and stride == [1, 1] and padding == [0, 0]:
        columns = x.reshape(n, x.shape[1], -1)
    else:
        # (N, C*kh*kw, L)
        columns = torch.nn.functional.unfold(x, kernel, tuple(dilation), tuple(padding), tuple(stride))
    positions = columns.shape[-1]
    grads = grad_output.reshape(n, k, positions).transpose(0, 1).reshape(k, n * positions)
    return torch.mm(grads, columns.transpose(1, 2).reshape(n * positions, -1)).view(shape)


def _weight_gradient_depthwise(grad_output: torch.Tensor, x: torch.Tensor, shape: tuple[int, ...],
                               stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
    """A depthwise convolution's weight gradient as one depthwise convolution of the input by
    the output gradient (each image and channel its own group), summed over the batch: tap
    (i, j) of channel c is sum over n, h, w of x_padded[n, c, s*h + d*i, s*w + d*j] * g[n, c, h, w]."""
    n, c = x.shape[:2]
    images = x.transpose(0, 1).reshape(1, c * n, *x.shape[2:])
    kernels = grad_output.transpose(0, 1).reshape(c * n, 1, *grad_output.shape[2:])
    taps = torch.nn.functional.conv2d(images, kernels, None, dilation, padding, stride, c * n)
    return taps[0, :, :shape[2], :shape[3]].reshape(c, n, shape[2], shape[3]).sum(1).view(shape)


def _is_plain_cpu_conv2d(x: torch.Tensor, transposed: bool) -> bool:
    return not transposed and x.device.type == "cpu" and x.dim() == 4 and x.dtype in (torch.float32, torch.float64)


def _gemm_weight_gradient(grad_output: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    positions = grad_output.numel() // grad_output.shape[1]
    if groups != 1 or positions > GEMM_WEIGHT_GRADIENT_MAX_POSITIONS:
        return False
    return weight.shape[2] * weight.shape[3] > 1 or positions >= 8 or torch.get_num_threads() > 1


def _depthwise_weight_gradient(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """Depthwise (one filter per channel) with a kernel of 5x5 taps or more: oneDNN's weight
    gradient there is 3-25x slower than the convolution that computes it."""
    return groups == x.shape[1] == weight.shape[0] and weight.shape[1] == 1 and \
        weight.shape[2] * weight.shape[3] >= DEPTHWISE_CONV_WEIGHT_GRADIENT_MIN_TAPS


def _memory_format_of(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 and not t.is_contiguous() and \
        t.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format


_KERNELS: dict[Any, Callable[..., Any]] = {_aten.max_pool2d_with_indices.default: max_pool2d_with_indices,
                                           _aten.convolution_backward.default: convolution_backward}


def select_kernels(graph: fx.Graph) -> bool:
    """Replace ops by implementations with the same results that run faster (the module
    docstring, point 4); True if any changed."""
    return _retarget(graph, _KERNELS)
