"""Kernels of the tensor-parallel collectives (popxl.addons' ``replicated_all_reduce_TP``).

A tensor-parallel all-reduce is an all-reduce (sum) over a replica group whose
gradient rule depends on what is known about the tensors around it, as in
popxl.addons' ``ReplicatedAllReduceTPOp``:

==========================  ================  ===================  ====================
form                        forward           gradient             grad op's form
==========================  ================  ===================  ====================
plain                       all-reduce        all-reduce           plain
``identical_inputs``        identity          all-reduce           ``identical_grad_inputs``
``identical_grad_inputs``   all-reduce        identity             ``identical_inputs``
==========================  ================  ===================  ====================

The grad op is the op with the two flags swapped. An op with ``identical_inputs`` (the
group's inputs are the same tensor) *can be replaced by an identity*; it does not run
as it is: PopART's ``OpToIdentityPattern`` replaces it (``popxl_addons.patterns``), and
the device refuses a program that still holds one, as PopART does (the check is in the
kernel, too, so it cannot be bypassed).

The op is a torch custom op (``torch.ops.ipuxl.all_reduce_tp``), one node however it is
traced, with an ``autograd.Function`` whose backward is the swapped op: autodiff traces
the forward and that backward, so the grad graph holds the grad op.

Two tensor-parallel ops are built on the collectives here:

- ``layer_norm_distributed``: a layer norm whose hidden axis is sharded over the group;
  the statistics are all-reduced (plain form: their gradients are all-reduced too), so
  autodiff gives upstream's distributed-statistics gradient.
- ``cross_entropy_sharded``: the cross entropy of logits sharded over the class axis
  (``torch.ops.ipuxl.cross_entropy_sharded``): a max, a sum and the loss all-reduced;
  its gradient is local (``softmax - onehot`` of this shard's classes, times the loss
  gradient, which is the same on every member), as popxl.addons' grad op.
"""
from __future__ import annotations

from typing import Any

import torch

from ipuxl.errors import DeviceError
from ipuxl.kernels import collectives

__all__ = ["all_reduce_tp", "can_be_replaced_by_identity", "PATTERN_NEEDED", "TP_ALL_REDUCE_TARGETS",
           "layer_norm_distributed", "cross_entropy_sharded", "CROSS_ENTROPY_SHARDED_TARGETS"]

#: PopART's message when a TP all-reduce that must become an identity reaches the device.
PATTERN_NEEDED = "You need to run the `OpToIdentityPattern` pattern before running the IR."


@torch.library.custom_op("ipuxl::all_reduce_tp", mutates_args=())
def _all_reduce_tp_op(t: torch.Tensor, op: str, stride: int, group_size: int, identical_inputs: bool,
                      identical_grad_inputs: bool) -> torch.Tensor:
    if identical_inputs:
        raise DeviceError(f"a replicated_all_reduce_TP with identical inputs reached the device: {PATTERN_NEEDED}",
                          fix="call popxl_addons.patterns.apply_pre_alias_patterns(ir) after autodiff and before "
                              "creating the Session")
    out = collectives.all_reduce(t, op, stride, group_size)
    return out.clone() if out.data_ptr() == t.data_ptr() else out


@_all_reduce_tp_op.register_fake
def _(t: torch.Tensor, op: str, stride: int, group_size: int, identical_inputs: bool,
      identical_grad_inputs: bool) -> torch.Tensor:
    return torch.empty_like(t)


class _AllReduceTP(torch.autograd.Function):
    @staticmethod
    def forward(t: torch.Tensor, op: str, stride: int, group_size: int, identical_inputs: bool,
                identical_grad_inputs: bool) -> torch.Tensor:
        return torch.ops.ipuxl.all_reduce_tp(t, op, stride, group_size, identical_inputs, identical_grad_inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        op, stride, group_size, identical_inputs, identical_grad_inputs = ctx.args
        # the grad op: the same all-reduce with the two flags swapped
        grad = all_reduce_tp(dy, op, stride, group_size, identical_grad_inputs, identical_inputs)
        return grad, None, None, None, None, None


def all_reduce_tp(t: torch.Tensor, op: str, stride: int, group_size: int, identical_inputs: bool,
                  identical_grad_inputs: bool) -> torch.Tensor:
    """The tensor-parallel all-reduce of ``t`` over its group (see the module docstring)."""
    if t.requires_grad:
        return _AllReduceTP.apply(t, op, stride, group_size, identical_inputs, identical_grad_inputs)
    return torch.ops.ipuxl.all_reduce_tp(t, op, stride, group_size, identical_inputs, identical_grad_inputs)


#: Node targets that are a TP all-reduce: the kernel as ``ops`` emit it, the traced custom op.
TP_ALL_REDUCE_TARGETS = (all_reduce_tp, torch.ops.ipuxl.all_reduce_tp, torch.ops.ipuxl.all_reduce_tp.default)


def can_be_replaced_by_identity(target: Any, args: tuple[Any, ...]) -> bool:
    """Whether a node ``target(*args)`` is a TP all-reduce with identical inputs (PopART's
    ``canBeReplacedByIdentity``): its arguments are ``(t, op, stride, group_size,
    identical_inputs, identical_grad_inputs)``."""
    return target in TP_ALL_REDUCE_TARGETS and len(args) >= 5 and bool(args[4])


# -- distributed layer norm ------------------------------------------------------------------------
def layer_norm_distributed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, stride: int,
                           group_size: int) -> torch.Tensor:
    """Layer norm over the last axis of ``x`` (N, H / group_size), the axis sharded over the
    group: the mean and the variance are those of the whole axis (two passes, as PopART's
    stable norm), ``weight`` and ``bias`` this shard's."""
    hidden = x.shape[-1] * group_size
    stats_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xf = x.to(stats_dtype)
    mean = all_reduce_tp(xf.sum(-1, keepdim=True), "add", stride, group_size, False, False) / hidden
    centred = xf - mean
    var = all_reduce_tp((centred * centred).sum(-1, keepdim=True), "add", stride, group_size, False, False) / hidden
    return (centred * torch.rsqrt(var + eps)).to(x.dtype) * weight + bias


# -- sharded cross entropy ---------------------------------------------------------------------------
@torch.library.custom_op("ipuxl::cross_entropy_sharded", mutates_args=())
def _cross_entropy_sharded_op(logits: torch.Tensor, indices: torch.Tensor, stride: int,
                              group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    classes = logits.shape[1]
    top = collectives.all_reduce(logits.amax(1), "max", stride, group_size)
    shifted = logits - top.unsqueeze(1)
    denominator = collectives.all_reduce(shifted.exp().sum(1), "add", stride, group_size)
    neg_log_softmax = denominator.log().unsqueeze(1) - shifted
    in_range = (indices >= 0) & (indices < classes)
    picked = neg_log_softmax.gather(1, torch.where(in_range, indices, 0).long().unsqueeze(1)).squeeze(1)
    loss = collectives.all_reduce(torch.where(in_range, picked, 0), "add", stride, group_size)
    return loss.clone(), neg_log_softmax


@_cross_entropy_sharded_op.register_fake
def _(logits: torch.Tensor, indices: torch.Tensor, stride: int,
      group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.new_empty(logits.shape[:1]), torch.empty_like(logits)


class _CrossEntropySharded(torch.autograd.Function):
    @staticmethod
    def forward(logits: torch.Tensor, indices: torch.Tensor, stride: int,
                group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        loss, neg_log_softmax = torch.ops.ipuxl.cross_entropy_sharded(logits, indices, stride, group_size)
        return loss, neg_log_softmax

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(output[1], inputs[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, loss_grad: torch.Tensor, _nls_grad: Any) -> tuple[Any, ...]:
        # popxl.addons' grad op: softmax * dloss - onehot * dloss, this shard's classes only
        neg_log_softmax, indices = ctx.saved_tensors
        classes = neg_log_softmax.shape[1]
        grad = (-neg_log_softmax).exp() * loss_grad.unsqueeze(1)
        in_range = (indices >= 0) & (indices < classes)
        onehot = torch.nn.functional.one_hot(torch.where(in_range, indices, 0).long(), classes).to(grad.dtype)
        return grad - onehot * (loss_grad * in_range.to(grad.dtype)).unsqueeze(1), None, None, None


def cross_entropy_sharded(logits: torch.Tensor, indices: torch.Tensor, stride: int, group_size: int) -> torch.Tensor:
    """The per-sample cross entropy of ``logits`` (N, classes of this shard) sharded over the
    class axis, for ``indices`` (N,) offset to this shard (out of range: another shard's
    class): the same (N,) loss on every member of the group."""
    if logits.requires_grad:
        return _CrossEntropySharded.apply(logits, indices, stride, group_size)[0]
    return torch.ops.ipuxl.cross_entropy_sharded(logits, indices, stride, group_size)[0]


#: Node targets of the sharded cross entropy (a collective: its forward all-reduces).
CROSS_ENTROPY_SHARDED_TARGETS = (cross_entropy_sharded, torch.ops.ipuxl.cross_entropy_sharded,
                                 torch.ops.ipuxl.cross_entropy_sharded.default)
