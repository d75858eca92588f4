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
"""
from __future__ import annotations

from typing import Any

import torch

from ipuxl.errors import DeviceError
from ipuxl.kernels import collectives

__all__ = ["all_reduce_tp", "can_be_replaced_by_identity", "PATTERN_NEEDED", "TP_ALL_REDUCE_TARGETS"]

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
