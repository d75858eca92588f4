"""PopTorch's ``ipu_print_tensor`` kernel: print a tensor in Poplar's layout at run time.

``torch.ops.ipuxl.ipu_print_tensor`` is a torch custom op, so a trace records it as one
node (the device runs it, and prints, every time the program runs) instead of printing
fake tensors while tracing. Its autograd formula prints the incoming gradient under
``"<title>_gradient"`` when ``print_gradient`` is set, so the grad graph prints it.

The layout follows Poplar's ``PrintTensorFmt`` as PopTorch's tests show it: nested
brackets, one row of the last dimension per line, rows not separated by the
separator, long rows wrapped at ``max_line_width``, large tensors summarised to their
``edge_items``. Printed to stderr, as Poplar prints.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PrintFormat", "format_tensor", "FLOAT_FORMATS"]

FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")


@dataclass(frozen=True)
class PrintFormat:
    """Poplar's print options (PopTorch's ``ipu_print_tensor`` arguments)."""

    summarise_threshold: int = 1000
    edge_items: int = 3
    max_line_width: int = 80
    digits: int = 4
    float_format: str = "auto"
    separator: str = ", "
    open_bracket: str = "("
    close_bracket: str = ")"


def format_tensor(title: str, t: torch.Tensor, fmt: PrintFormat) -> str:
    """``"title: "`` (when a title is given) and the values of ``t`` laid out as Poplar prints them."""
    t = t.detach().cpu()
    summarise = 0 < fmt.summarise_threshold < t.numel()
    elements = _element_formatter(t, fmt)
    body = elements(t) if t.dim() == 0 else _nested(t, 0, summarise, elements, fmt)
    return f"{title}: {body}" if title else body


def _element_formatter(t: torch.Tensor, fmt: PrintFormat) -> Any:
    """A function formatting one 0-d tensor; floats share one format and width when ``digits``."""
    if t.dtype == torch.bool:
        return lambda v: "1" if bool(v) else "0"
    if not t.is_floating_point():
        return _aligned(lambda v: str(int(v)), t, fmt)
    values = t.double()
    finite = values[torch.isfinite(values)].abs()
    style = fmt.float_format
    if style == "auto":
        biggest = float(finite.max()) if finite.numel() else 0.0
        smallest = float(finite[finite > 0].min()) if (finite > 0).any() else 1.0
        style = "fixed" if biggest < 10 ** max(fmt.digits, 1) and smallest >= 1e-4 else "scientific"
    if style == "none" or fmt.digits == 0:
        return lambda v: _special(float(v)) or (f"{float(v):.{fmt.digits}g}" if fmt.digits else repr(float(v)))
    if style == "scientific":
        return _aligned(lambda v: _special(float(v)) or f"{float(v):.{max(fmt.digits - 1, 0)}e}", t, fmt)
    biggest = float(finite.max()) if finite.numel() else 0.0
    whole_digits = max(int(math.floor(math.log10(biggest))) + 1, 1) if biggest > 0 else 1
    decimals = max(fmt.digits - whole_digits, 1)  # a float keeps its point
    return _aligned(lambda v: _special(float(v)) or f"{float(v):.{decimals}f}", t, fmt)


def _special(v: float) -> str:
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else ""


def _aligned(one: Any, t: torch.Tensor, fmt: PrintFormat) -> Any:
    """``one`` right-aligned to the widest element of ``t`` (no alignment when ``digits`` is 0)."""
    if fmt.digits == 0 or t.numel() == 0:
        return one
    width = max(len(one(v)) for v in t.reshape(-1))
    return lambda v: one(v).rjust(width)


def _nested(t: torch.Tensor, depth: int, summarise: bool, elements: Any, fmt: PrintFormat) -> str:
    """``t`` (at least 1-d) in brackets; the last dimension on one (wrapped) line."""
    indices = _shown(t.shape[0], summarise, fmt.edge_items)
    if t.dim() == 1:
        return _row([elements(t[i]) if i is not None else "..." for i in indices], depth, fmt)
    pad = " " * (depth + 1)
    inner = [pad + (_nested(t[i], depth + 1, summarise, elements, fmt) if i is not None else "...")
             for i in indices]
    return fmt.open_bracket + "\n" + "\n".join(inner) + "\n" + " " * depth + fmt.close_bracket


def _shown(n: int, summarise: bool, edge: int) -> list[int | None]:
    """The indices printed along a dimension of length ``n`` (None: the ellipsis)."""
    if summarise and n > 2 * edge:
        return [*range(edge), None, *range(n - edge, n)]
    return list(range(n))


def _row(items: list[str], depth: int, fmt: PrintFormat) -> str:
    """One bracketed row, broken before an element that would pass ``max_line_width``."""
    lines = [" " * depth + fmt.open_bracket]
    indent = " " * (depth + len(fmt.open_bracket) + 1)
    for k, item in enumerate(items):
        last = k == len(items) - 1
        piece = item + (fmt.close_bracket if last else fmt.separator)
        if k and fmt.max_line_width and len(lines[-1]) + len(item) > fmt.max_line_width:
            lines[-1] = lines[-1].rstrip()
            lines.append(indent)
        lines[-1] += piece
    return "\n".join(lines)[depth:]


# The op is defined with ``torch.library`` directly (not ``custom_op``) to own its
# Autograd kernel: ``custom_op``'s ``register_autograd`` builds an autograd.Function
# that functorch refuses, and ipuxl's autodiff differentiates under ``torch.func.vjp``.
_lib = torch.library.Library("ipuxl", "FRAGMENT")
_lib.define("ipu_print_tensor(Tensor t, str title, bool print_gradient, int summarise_threshold, int edge_items, "
            "int max_line_width, int digits, str float_format, str separator, str open_bracket, "
            "str close_bracket) -> Tensor")
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA)


def _print(t: torch.Tensor, title: str, print_gradient: bool, summarise_threshold: int, edge_items: int,
           max_line_width: int, digits: int, float_format: str, separator: str, open_bracket: str,
           close_bracket: str) -> torch.Tensor:
    fmt = PrintFormat(summarise_threshold, edge_items, max_line_width, digits, float_format, separator,
                      open_bracket, close_bracket)
    print(format_tensor(title, t, fmt), file=sys.stderr, flush=True)
    return t.clone()


def _fake(t: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(t)


def _autograd(keyset: Any, t: torch.Tensor, title: str, print_gradient: bool, *fmt: Any) -> torch.Tensor:
    """Print below autograd; when ``t`` requires grad, pass the gradient straight through
    ``t`` and print it on its way back (a hook that calls this op on it)."""
    below = keyset
    for key in _AUTOGRAD_KEYS:
        below = below.remove(key)
    printed = torch.ops.ipuxl.ipu_print_tensor.default.redispatch(below, t, title, print_gradient, *fmt)
    if not (torch.is_grad_enabled() and t.requires_grad):
        return printed
    out = torch.where(torch.ones((), dtype=torch.bool, device=t.device), t, printed)  # t's values and gradient
    if print_gradient:
        out.register_hook(lambda grad: torch.ops.ipuxl.ipu_print_tensor(grad, f"{title}_gradient", False, *fmt))
    return out


_lib.impl("ipu_print_tensor", _print, "CompositeExplicitAutograd")
_lib.impl("ipu_print_tensor", _autograd, "Autograd", with_keyset=True)
torch.library.register_fake("ipuxl::ipu_print_tensor", _fake, lib=_lib)
