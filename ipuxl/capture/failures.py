"""What a failed or refused trace tells the user: ``TraceError``s that keep torch's type.

* ``raised_by_forward``: an exception the user's own code raised (its ``raise`` statement,
  or a Python operation on its line: ``ValueError("Hi")``, ``some_list[9]``, a failed
  ``assert`` on shapes) reaches the caller as itself, with its type, message and notes
  unchanged, as PopTorch lets it through (its traceback shows the user's line);
  ``note_capture`` records that line as its ``where``, as ipuxl's errors have one.
* ``refuse_tensor_slice``: ``t[start:end]`` with tensor bounds gets PopTorch's error (its
  size would depend on their values); a boolean-mask index gets PopTorch's words too.
* ``trace_error``: an exception raised while a module's forward ran under make_fx
  becomes a ``TraceError`` naming the module and the user's line. When eager
  PyTorch would raise a built-in type for the same call (a ``TypeError`` for a bad
  argument, an ``IndexError`` for an index out of range...), the error is also an
  instance of that type (``error_class``, from ``errors.with_builtin``), with the
  original as ``__cause__`` and its message kept, so ``except IndexError`` handlers
  keep working.
  Tracing runs meta kernels, whose messages differ from eager's (``a and b must
  have same reduction dim`` for ``mat1 and mat2 shapes cannot be multiplied``):
  ``eager_error`` replays a failed call eagerly, on zeros of the same shapes, to
  raise eager's own error instead.
* ``refuse_data_dependent``: an op whose output shape depends on tensor values
  (``x[mask]``, ``nonzero``, ``bincount``, ``unique``, ``masked_select``) traces to
  a shape with unknown sizes; PopTorch refuses such ops, and so does ipuxl, naming
  the op, the module and the line, with the static-shape way to write it.
* an ``autograd.Function`` of torch's that functorch cannot run is named, with what to call
  instead (a model's own run through ``capture.custom_functions``, as does torch's reentrant
  ``checkpoint``).
"""
from __future__ import annotations

import linecache
import re

from typing import Any, Callable, cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ipuxl.errors import TraceError, builtin_type, with_builtin
from ipuxl.ir.context import traceback_source_line, user_source_line
from ipuxl.source import is_user_file

__all__ = ["refuse_tensor_slice", "raised_by_forward", "note_capture", "trace_error", "error_class", "eager_error",
           "refuse_data_dependent", "user_line", "DATA_DEPENDENT"]

# words in torch's messages that mean "a tensor's value decided something at trace time"
DATA_DEPENDENT = ("DataDependent", "data-dependent", "data dependent", "GuardOnDataDependent", "item()",
                  "Could not guard", "_local_scalar_dense", "tolist()")


def error_class(builtin: type[BaseException]) -> type[TraceError]:
    """``TraceError``, or its subclass that is also the built-in exception ``builtin``
    (``errors.with_builtin``)."""
    return cast("type[TraceError]", with_builtin(TraceError, builtin))


def eager_error(func: Callable, args: tuple, kwargs: dict, failure: Exception) -> Exception | None:
    """The exception eager PyTorch raises for ``func(*args, **kwargs)``, which failed with
    ``failure`` while tracing: the call replayed with every tensor replaced by zeros of
    its shape and dtype. None when that call succeeds, or when ``failure`` came from
    values not known while tracing (nothing to replay)."""
    if _is_data_dependent(failure):
        return None
    tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    if any(not isinstance(s, int) for t in tensors for s in t.shape):
        return None

    def real(value: Any) -> Any:
        return torch.zeros(tuple(value.shape), dtype=value.dtype) if isinstance(value, torch.Tensor) else value

    try:
        with _disable_current_modes(), torch.no_grad():
            real_args, real_kwargs = pytree.tree_map(real, (args, kwargs))
            func(*real_args, **real_kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever eager raises is the answer
        return exc
    return None


# torch's messages for an autograd.Function under the capture's functorch transforms
_CUSTOM_FUNCTION = ("Functionalize rule for custom_function_call", "must override the setup_context staticmethod")


def _custom_function(exc: BaseException) -> type | None | bool:
    """The ``torch.autograd.Function`` whose ``apply`` raised ``exc`` (functorch cannot run it):
    the class an ``X.apply(`` names on the innermost line of the traceback that has one; True
    when no line names it; False for other errors."""
    if not any(k in str(exc) for k in _CUSTOM_FUNCTION):
        return False
    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    for tb in reversed(frames):  # ``apply`` runs in C: the frames are its callers'
        frame = tb.tb_frame
        for dotted in _APPLY.findall(linecache.getline(frame.f_code.co_filename, tb.tb_lineno)):
            head, *rest = dotted.split(".")
            found = frame.f_locals.get(head, frame.f_globals.get(head))
            for attribute in rest:
                found = getattr(found, attribute, None)
            if isinstance(found, type) and issubclass(found, torch.autograd.Function):
                return found
    return True


_APPLY = re.compile(r"([A-Za-z_][\w.]*)\.apply\s*\(")


def _custom_op_without_fake(exc: BaseException) -> bool:
    """Whether tracing failed for want of a custom op's fake (shape) implementation: torch's message
    for a ``custom_op``, or fake tensors' refusal of an op outside aten with no meta kernel."""
    if "no fake impl registered" in str(exc):
        return True
    func = getattr(exc, "func", None)
    return (type(exc).__name__ == "UnsupportedOperatorException" and isinstance(func, torch._ops.OpOverload)
            and func.namespace not in ("aten", "prims"))


def _is_data_dependent(exc: Exception) -> bool:
    return any(k in f"{type(exc).__name__} {exc}" for k in DATA_DEPENDENT)


SLICE_SIZE = ("The size of the sliced tensor must be a constant for each execution of the model when running "
              "on the IPU.")
_INDEXING = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__})


def refuse_tensor_slice(func: Callable, args: tuple, failure: Exception) -> None:
    """PopTorch's error for ``t[start:end]`` with tensor bounds (``failure``: their values,
    unknown at capture, were needed for the slice's size)."""
    if func not in _INDEXING or len(args) < 2 or not _is_data_dependent(failure):
        return
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if any(isinstance(i, slice) and any(isinstance(b, torch.Tensor) for b in (i.start, i.stop, i.step))
           for i in index):
        raise TraceError(f"{SLICE_SIZE} A slice t[start:end] with tensor bounds has a size that depends on their "
                         "values, which are not known while capturing", where=user_line_of(failure),
                         fix="slice a constant size from a tensor start with poptorch.dynamic_slice(t, dim, start, "
                             "size, step)") from failure


def user_line_of(exc: BaseException) -> str | None:
    """The user's line in ``exc``'s traceback, else the innermost user frame calling now."""
    return traceback_source_line(exc.__traceback__) or user_source_line()


def raised_by_forward(exc: BaseException) -> bool:
    """Whether the user's code raised ``exc`` itself: the innermost frame of its traceback is
    in a user file (not torch's, ipuxl's or the standard library's; installed libraries
    count as the user's), so no torch or ipuxl machinery failed."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return is_user_file(tb.tb_frame.f_code.co_filename)


def note_capture(exc: BaseException) -> None:
    """Record on ``exc`` (raised by a forward while it was captured) the user's line, as the
    ``where`` that ipuxl's own errors carry, unless it has one; ``str(exc)`` and its notes are
    unchanged (``pytest.raises(match=)`` reads both), and its traceback shows the line too."""
    where = traceback_source_line(exc.__traceback__)
    if where is not None and not hasattr(exc, "where"):
        try:
            exc.where = where  # type: ignore[attr-defined]
        except AttributeError:  # an exception class with __slots__ or a read-only ``where``
            pass


def trace_error(module_name: str, exc: Exception) -> TraceError:
    """The ``TraceError`` for ``exc``, raised while tracing module ``module_name`` (see the
    module docstring); raise it ``from exc``."""
    message = str(exc).strip()
    function = _custom_function(exc)
    if function is not False:
        name = (f"{function.__module__}.{function.__qualname__}" if isinstance(function, type)
                else "an autograd.Function")
        return TraceError(
            f"cannot capture module {module_name}: it calls {name}, which torch's functional transforms (a "
            "capture runs under them) cannot run; the autograd.Functions a model defines run with their own "
            "backward, torch's and ipuxl's do not", where=traceback_source_line(exc.__traceback__),
            fix=("a module's full backward hooks (register_full_backward_hook / _pre_hook) are not run in a capture: "
                 "register a gradient hook on the module's output or input inside forward (tensor.register_hook), "
                 "which runs as eagerly" if name == "torch.nn.modules._functions.BackwardHookFunction" else
                 "call its forward's ops instead, or define the Function in your own module (its backward is then "
                 "kept)"))
    if _is_data_dependent(exc):
        message = message.splitlines()[0] if message else ""
        fix = _library_fix(exc) or (
            "tensor values are not known while capturing: replace Python control flow on tensor values "
            "and .item()/.tolist()/bool(tensor) by tensor ops (torch.where, masks), or do that work on the host")
        cls: type[TraceError] = TraceError
    elif _custom_op_without_fake(exc):
        fix = ("give the custom op a fake implementation with torch.library.register_fake (or @op.register_fake): "
               "it makes empty outputs of the right shapes and dtypes, which tracing needs (torch.compile and "
               "torch.export need it too)")
        cls = TraceError
    elif hop := re.search(r"Higher Order Operator: (\S+)", message):  # torch.cond, torch.while_loop...
        message = f"{hop.group(1)} needs torch.compile's Dynamo to trace the functions it is given"
        fix = ("ipuxl does not capture torch's control-flow operators: compute both branches and select with "
               "torch.where, or use poptorch.cond (inference) or poptorch.for_loop")
        cls = TraceError
    else:
        fix = ("check that call's arguments (shapes, dims, dtypes, indices): eager PyTorch raises the same error "
               "for them; if it runs eagerly, rewrite it with standard torch ops")
        cls = error_class(builtin_type(exc))
    return cls(f"cannot capture module {module_name}: {type(exc).__name__}: {message}",
               where=traceback_source_line(exc.__traceback__), fix=fix)


# Library functions that read a tensor's value to choose a path, and the argument that
# tells them instead (what torch.export needs from the caller too). Values computed from
# constants alone are read at capture (``capture.known_values``); these are for masks
# and the like that come from the module's inputs.
_LIBRARY_CHECKS = {
    "flex_attention_mask": (
        "tensor values are not known while capturing: Hugging Face's flex-attention mask checks whether the "
        "attention mask is all ones before adding its padding; use attn_implementation='sdpa' (same results), or "
        "pass no attention_mask when no sequence is padded"),
    "_nested_tensor_from_mask_left_aligned": (
        "tensor values are not known while capturing: nn.TransformerEncoder's nested-tensor fast path "
        "checks the padding mask's values; construct it with enable_nested_tensor=False"),
}


# Hugging Face's mixture-of-experts layers in their "eager" form loop over the experts that the
# batch routes tokens to: a loop on tensor values. Their other forms are what torch.compile runs.
_EAGER_EXPERTS = (
    "tensor values are not known while capturing: Hugging Face's 'eager' experts implementation loops over "
    "the experts the batch routes tokens to; use the implementation torch.compile uses: "
    "model.set_experts_implementation('grouped_mm') (or 'batched_mm'), or from_pretrained(..., "
    "experts_implementation='grouped_mm')")


def _library_fix(exc: BaseException) -> str | None:
    """The argument that spares a known library function its read of tensor values, when
    one of them made it (see ``_LIBRARY_CHECKS``, ``_EAGER_EXPERTS``)."""
    tb = exc.__traceback__
    while tb is not None:
        fix = _LIBRARY_CHECKS.get(tb.tb_frame.f_code.co_name)
        if fix is not None:
            return fix
        frame = tb.tb_frame
        config = getattr(frame.f_locals.get("self"), "config", None)  # the experts' dispatching forward:
        if (frame.f_code.co_filename.replace("\\", "/").endswith("transformers/integrations/moe.py")
                and getattr(config, "_experts_implementation", None) == "eager"):
            return _EAGER_EXPERTS
        tb = tb.tb_next
    return None


# how to write each refused op with a static shape
_STATIC_FORMS = {
    "nonzero": "use a mask with static shape instead: torch.where(mask, x, 0), x * mask, or "
               "torch.nonzero_static(mask, size=N) with a fixed N",
    "masked_select": "use torch.where(mask, x, 0) or x * mask (same shape as x) and reduce that",
    "index": "index with a mask of static shape instead: torch.where(mask, x, 0) or x * mask (same shape "
             "as x), then reduce that",
    "bincount": "count with a known number of bins: F.one_hot(x, num_classes=N).sum(0), or "
                "torch.zeros(N).scatter_add_(0, x, torch.ones_like(x, dtype=torch.float))",
    "unique": "compute it on the host, or compare against a known set of values (x[:, None] == values)",
}
_GENERIC_FORM = "rewrite it with ops whose output shapes follow from the input shapes (torch.where, masks)"


def refuse_data_dependent(gm: fx.GraphModule, module_name: str) -> None:
    """Raise a ``TraceError`` at the first op of ``gm`` whose output shape depends on values."""
    for node in gm.graph.nodes:
        shape = _unknown_shape(node.meta.get("val"))
        if node.op != "call_function" or shape is None:
            continue
        op = _op_name(node)
        fix = next((form for key, form in _STATIC_FORMS.items() if key in op), _GENERIC_FORM)
        raise TraceError(
            f"{_BOOL_MASK if _bool_mask_index(node) else ''}module {module_name} uses aten.{op}, whose output "
            "shape depends on tensor values (shape "
            f"{shape}); like PopTorch, ipuxl needs every shape known when the program is compiled "
            "(boolean-mask indexing x[mask], nonzero, masked_select, bincount and unique have such shapes)",
            where=user_line(node.meta.get("stack_trace")), fix=fix)


_BOOL_MASK = ("Indexing using boolean or byte tensor masks is unsupported because it would produce dynamic output "
              "shapes based on the mask values. The IPU cannot support dynamic output shapes. ")


def _bool_mask_index(node: fx.Node) -> bool:
    """An ``aten.index`` whose indices include a boolean or byte mask."""
    if node.target not in (torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor) or len(node.args) < 2:
        return False
    masks = node.args[1] if isinstance(node.args[1], (list, tuple)) else ()
    return any(isinstance(i, fx.Node) and getattr(i.meta.get("val"), "dtype", None) in (torch.bool, torch.uint8)
               for i in masks)


def _unknown_shape(val: object) -> tuple | None:
    """The first shape in a node's value (a tensor, or a tuple of them) with a size not known
    at trace time, or None."""
    for t in val if isinstance(val, (tuple, list)) else (val,):
        if isinstance(t, torch.Tensor) and any(not isinstance(s, int) for s in t.shape):
            return tuple(t.shape)
    return None


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def user_line(stack_trace: str | None) -> str | None:
    """``file:line in function`` of the innermost user frame of a make_fx stack trace."""
    found = None
    for filename, line, function in _FRAME.findall(stack_trace or ""):
        if is_user_file(filename):
            found = f"{filename}:{line} in {function}"
    return found

