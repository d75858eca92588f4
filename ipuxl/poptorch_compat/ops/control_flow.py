"""PopTorch's control flow ops: ``for_loop`` and ``cond``.

``for_loop`` is unrolled while tracing (``count`` copies of the body in the program),
so it also trains; ``cond`` in a traced model computes both branches and selects each
output (``torch.where``), and is for inference, as upstream.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ipuxl.capture.mode import active_mode
from ipuxl.errors import OpContextError
from ipuxl.ir.context import user_source_line
from ipuxl.poptorch_compat.ops.arguments import Tensors, as_list, bad_arg, differentiated, spec_of

__all__ = ["for_loop", "cond"]


def for_loop(count: int, body: Callable[..., Any], inputs: Tensors) -> Tensors:
    """Run ``body`` ``count`` times, each iteration's outputs being the next one's inputs.

    As PopTorch: ``inputs`` is a list of tensors passed by value (the caller's tensors
    are never changed), and the body returns as many tensors as it takes, with the
    same shapes and dtypes. Returns the last outputs as a list.

    ipuxl unrolls the loop while tracing (the program holds ``count`` copies of the
    body), so it also differentiates it: PopTorch refuses ``for_loop`` in training,
    ipuxl trains through it with eager PyTorch's gradients.

    Raises:
        OpArgumentError: ``inputs`` is not a list of tensors, ``count`` is not an int
            >= 0, or the body's outputs do not match its inputs.
    """
    fix = "pass the loop inputs as a list of tensors, e.g. poptorch.for_loop(n, body, [x, y])"
    if not isinstance(inputs, list):
        raise bad_arg("poptorch.for_loop expects input tensors (inputs) to be a list of tensors. (Object is not list)",
                      fix)
    for ind, tensor in enumerate(inputs):
        if not isinstance(tensor, torch.Tensor):
            raise bad_arg("poptorch.for_loop expects input tensors (inputs) to be a list of tensors. (Object contained "
                          f"in list at index {ind} is not torch.tensor)", fix)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise bad_arg(f"poptorch.for_loop: count must be an int >= 0, got {count!r}", "pass the number of iterations")
    state = list(inputs)
    for iteration in range(count):
        outputs = as_list(body(*[t.clone() for t in state]))  # by value: the body may write its inputs
        _check_loop_outputs(state, outputs, iteration)
        state = outputs
    return [t.clone() for t in state] if count == 0 else state


def _check_loop_outputs(inputs: Tensors, outputs: list[Any], iteration: int) -> None:
    expected, got = [spec_of(t) for t in inputs], [spec_of(t) for t in outputs]
    if expected != got:
        raise bad_arg(f"poptorch.for_loop: the body must return tensors matching its inputs in number, shape and "
                      f"dtype; it takes {expected} but returned {got} (iteration {iteration})",
                      "return one tensor per loop input, each of that input's shape and dtype")


def cond(condition: torch.Tensor | bool, then_body: Callable[..., Any], then_inps: list[Any],
         else_body: Callable[..., Any], else_inps: list[Any]) -> Tensors:
    """``then_body(*then_inps)`` if ``condition`` else ``else_body(*else_inps)``, as a list of tensors.

    As PopTorch: ``condition`` is a one-element tensor (or a bool); inputs are passed by
    copy; the branches may use tensors of the caller; both return the same number of
    tensors. In a traced model ipuxl runs both branches and selects each output with
    ``torch.where``, so corresponding outputs must have one shape and dtype, and side
    effects of both branches (prints, CPU ops) happen. As in PopTorch, ``cond`` is for
    inference: a cond whose outputs a training model differentiates raises.

    Raises:
        OpArgumentError: the inputs are not lists, the condition has more than one
            element, or the branches' outputs do not correspond.
        OpContextError: a training model differentiates through the cond.
    """
    if not isinstance(then_inps, list) or not isinstance(else_inps, list):
        raise bad_arg("poptorch.cond expects then_inps and else_inps tensors to be a list of tensors. "
                      "(Object is not list)", "pass the branch inputs as lists, e.g. [x] (or [] for none)")
    if active_mode() is None or not isinstance(condition, torch.Tensor):
        taken = then_body(*then_inps) if condition else else_body(*else_inps)
        return as_list(taken)
    if condition.numel() != 1:
        raise bad_arg(f"poptorch.cond: the condition must have one element, got shape {tuple(condition.shape)}",
                      "reduce the condition to one boolean, e.g. cond.all() or cond.any()")
    then_out, else_out = as_list(then_body(*_by_copy(then_inps))), as_list(else_body(*_by_copy(else_inps)))
    _check_branches(then_out, else_out)
    _refuse_differentiated(then_out + else_out)
    pick = condition.reshape(()).to(torch.bool)
    return [torch.where(pick, a, b) for a, b in zip(then_out, else_out)]


def _by_copy(values: list[Any]) -> list[Any]:
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


def _check_branches(then_out: list[Any], else_out: list[Any]) -> None:
    then_specs, else_specs = [spec_of(t) for t in then_out], [spec_of(t) for t in else_out]
    if len(then_out) != len(else_out):
        raise bad_arg(f"poptorch.cond: then_body and else_body have to return the same number of outputs; then_body "
                      f"returned {len(then_out)} ({then_specs}), else_body {len(else_out)} ({else_specs})",
                      "return the same number of tensors from both branches")
    if then_specs != else_specs or not all(isinstance(t, torch.Tensor) for t in then_out + else_out):
        raise bad_arg(f"poptorch.cond: corresponding outputs of then_body and else_body must be tensors of one shape "
                      f"and dtype (ipuxl selects between them); then_body returned {then_specs}, else_body "
                      f"{else_specs}", "cast or reshape the outputs so that both branches return the same specs")


def _refuse_differentiated(outputs: Tensors) -> None:
    if differentiated(outputs):
        raise OpContextError("poptorch.cond() is only supported in inference (its outputs depend on trained "
                             "parameters here)", where=user_source_line(),
                             fix="use poptorch.cond in an inferenceModel, or compute both branches and select "
                                 "with torch.where in a training model")
