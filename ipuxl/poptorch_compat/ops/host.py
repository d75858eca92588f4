"""PopTorch's ops that reach the host while the program runs: ``ipu_print_tensor``, ``CPU``
and ``custom_op``.

``ipu_print_tensor`` and ``CPU`` are torch custom ops (``ipuxl.kernels``) that the device
runs, so they print / call the host every time the program runs; ``custom_op`` runs a
Python implementation registered with ``register_custom_op`` (an ipuxl extension).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from ipuxl.capture.mode import active_mode
from ipuxl.errors import OpContextError
from ipuxl.ir.context import user_source_line
from ipuxl.kernels import host_callbacks
from ipuxl.kernels.poplar_print import FLOAT_FORMATS
from ipuxl.poptorch_compat.ops.arguments import Tensors, as_list, bad_arg, check_tensor, differentiated, spec_of

__all__ = ["ipu_print_tensor", "CPU", "register_custom_op", "custom_op"]


# -- printing -------------------------------------------------------------------------------------------------
def ipu_print_tensor(tensor: torch.Tensor, title: str = "", print_gradient: bool = True,
                     summarise_threshold: int = 1000, edge_items: int = 3, max_line_width: int = 80,
                     digits: int = 4, float_format: str = "auto", separator: str = ", ",
                     open_bracket: str = "(", close_bracket: str = ")") -> torch.Tensor:
    """Print ``tensor`` to stderr every time the program runs, in Poplar's layout; returns a copy.

    As PopTorch: use the returned tensor (an unused print may be removed); in training
    the gradient reaching it is printed too, titled ``"<title>_gradient"``, when
    ``print_gradient``. ``summarise_threshold`` (0: never) shows only ``edge_items`` per
    dimension of larger tensors; ``max_line_width`` (0: never) wraps rows; ``digits``
    (0: unaligned) sets the precision; ``float_format`` is ``"auto"``, ``"fixed"``,
    ``"scientific"`` or ``"none"``.
    """
    check_tensor(tensor, "ipu print tensor must take a torch.tensor argument.")
    if float_format not in FLOAT_FORMATS:
        raise bad_arg(f"ipu_print_tensor: float_format must be one of {FLOAT_FORMATS}, got {float_format!r}",
                      "pass one of those strings")
    ints = dict(summarise_threshold=summarise_threshold, edge_items=edge_items, max_line_width=max_line_width,
                digits=digits)
    for name, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad_arg(f"ipu_print_tensor: {name} must be an int >= 0, got {value!r}", f"pass {name} as an int")
    return torch.ops.ipuxl.ipu_print_tensor(tensor, str(title), bool(print_gradient), summarise_threshold,
                                            edge_items, max_line_width, digits, float_format, str(separator),
                                            str(open_bracket), str(close_bracket))


# -- host callbacks -------------------------------------------------------------------------------------------
class CPU:
    """Run ``layer_to_call`` on the host in the middle of the device program (PopTorch's CPU op).

    Calling the wrapper inside a model's forward records one host callback: each time
    the program runs, the device passes the current input values to ``layer_to_call``
    and continues with its outputs, which must keep the shapes and dtypes they had
    when the model was traced (PopTorch traces by calling it on zeros; so does ipuxl).
    Outside a traced model the wrapper simply calls ``layer_to_call``. As in PopTorch,
    CPU ops are for inference: no gradient flows through them (a module's parameters
    are set not to require grad), and a training model whose trained parameters feed
    one raises. Keep the wrapper alive while the model runs.
    """

    def __init__(self, layer_to_call: Callable[..., Any], ID: str):
        self._layer_to_call = layer_to_call
        if isinstance(layer_to_call, torch.nn.Module):
            layer_to_call.requires_grad_(False)
        self._ID = ID
        self.in_shapes: list[torch.Size] | None = None
        self.out_shapes: list[torch.Size] | None = None
        self._callbacks: dict[tuple, tuple[host_callbacks.Callback, int]] = {}
        self._single: dict[tuple, bool] = {}  # per input specs: the layer returned one tensor

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        if active_mode() is None:
            return self._layer_to_call(*input)
        for t in input:
            check_tensor(t, f"CPU op '{self._ID}' takes tensors only;")
        if differentiated(input):
            raise OpContextError(f"CPU op '{self._ID}': CPU ops are only supported in inference graphs (its "
                                 "inputs depend on trained parameters here)", where=user_source_line(),
                                 fix="use the CPU op in an inferenceModel, or only on values that need no "
                                     "gradient (inputs, or tensors under torch.no_grad())")
        key = tuple((tuple(t.shape), t.dtype) for t in input)
        if key not in self._callbacks:
            self._callbacks[key] = self._register(key)
        callback, handle = self._callbacks[key]
        self.in_shapes = [t.shape for t in input]
        self.out_shapes = [torch.Size(shape) for shape, _ in callback.outputs]
        outputs = torch.ops.ipuxl.host_callback([t.detach() for t in input], handle)
        return outputs[0] if self._single[key] else list(outputs)

    def _register(self, key: tuple) -> tuple[host_callbacks.Callback, int]:
        """Call the layer on zeros (in a thread of its own, outside the trace) to learn its outputs."""
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                with torch.no_grad():
                    result["out"] = self._layer_to_call(*[torch.zeros(s, dtype=d) for s, d in key])
            except Exception as exc:  # re-raised in the tracing thread, with its type
                result["error"] = exc

        worker = threading.Thread(target=run, name=f"poptorch.CPU {self._ID}")
        worker.start()
        worker.join()
        if "error" in result:
            raise result["error"]
        outs = result["out"]
        self._single[key] = not isinstance(outs, (list, tuple))
        outs = as_list(outs)
        for o in outs:
            check_tensor(o, f"CPU op '{self._ID}' must return tensors;")
        callback = host_callbacks.Callback(self._layer_to_call, str(self._ID),
                                           [(tuple(o.shape), o.dtype) for o in outs])
        return callback, host_callbacks.register(callback)


# -- custom ops -----------------------------------------------------------------------------------------------
_custom_ops: dict[tuple[str, str, int], Callable[..., Any]] = {}


def register_custom_op(name: str, domain: str, domain_version: int, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as the implementation of ``poptorch.custom_op(..., name, domain, domain_version, ...)``.

    An ipuxl extension: PopTorch's custom ops are C++ PopART ops, which cannot run
    here; ``fn(*inputs, **attributes)`` is torch code returning the op's outputs (a
    tensor or a tuple of them), traced into the program and differentiated by
    autograd like the rest of the model. Registering the same key again replaces it.
    """
    if not callable(fn):
        raise bad_arg(f"register_custom_op: fn must be callable, got {type(fn).__name__}", "pass a function")
    _custom_ops[(str(domain), str(name), int(domain_version))] = fn


def custom_op(inputs: Sequence[torch.Tensor], name: str, domain: str, domain_version: int,
              example_outputs: Sequence[torch.Tensor],
              attributes: dict[str, float | int | str | list | tuple] | None = None) -> Tensors:
    """Apply the custom op ``domain::name`` (version ``domain_version``) to ``inputs``; returns its outputs.

    ``attributes`` are checked as PopTorch checks them and passed to the implementation
    as keyword arguments; the outputs must match ``example_outputs`` in number, shape
    and dtype. Implementations are Python functions registered with
    ``register_custom_op`` (C++ PopART custom ops cannot run on ipuxl).

    Raises:
        OpArgumentError: bad attributes, or outputs that do not match ``example_outputs``.
        OpContextError: no Python implementation is registered for the op.
    """
    _check_attributes(attributes)
    fn = _custom_ops.get((str(domain), str(name), int(domain_version)))
    if fn is None:
        raise OpContextError(
            f"custom op '{domain}::{name}' (version {domain_version}) has no Python implementation; PopART (C++) "
            "custom ops cannot run on ipuxl's simulated IPU", where=user_source_line(),
            fix=f"register one: ipuxl.poptorch_compat.ops.register_custom_op({name!r}, {domain!r}, "
                f"{domain_version}, fn) with fn(*inputs, **attributes) written in torch")
    outputs = as_list(fn(*inputs, **(attributes or {})))
    expected, got = [spec_of(t) for t in example_outputs], [spec_of(t) for t in outputs]
    if expected != got:
        raise bad_arg(f"custom op '{domain}::{name}' returned {got}, but example_outputs promise {expected}",
                      "make the implementation return tensors of the example outputs' shapes and dtypes")
    return outputs


def _check_attributes(attributes: dict[str, Any] | None) -> None:
    """PopTorch's checks: string keys, and values that are floats, ints, ASCII strings, or
    non-mixed lists/tuples of them."""
    fix = "use str keys and float/int/str values (or lists/tuples of one of those types), ASCII only"
    for key, value in (attributes or {}).items():
        if not isinstance(key, str):
            raise bad_arg("All attribute keys must be strings.", fix)
        if not isinstance(value, (float, int, str, list, tuple)):
            raise bad_arg("Attribute values must be floats, ints, strings or a list/tuple of float, ints of strings.",
                          fix)
        if isinstance(value, (list, tuple)) and any(not isinstance(v, type(value[0])) for v in value):
            raise bad_arg("The types in a list/tuple attribute must all be the same.", fix)
        for text in [key, *(value if isinstance(value, (list, tuple)) else [value])]:
            if isinstance(text, str) and not text.isascii():
                raise bad_arg(f"{text} contains non-ASCII characters.", fix)
