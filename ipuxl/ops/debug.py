"""Ops that create or show tensors outside any computation: ``init`` and ``print_tensor``."""
from __future__ import annotations

from typing import Any, Iterable, Literal

import torch

from ipuxl.dtypes import from_any
from ipuxl.errors import InvalidValueError
from ipuxl.ir.build import emit
from ipuxl.ir.context import user_source_line
from ipuxl.ir.tensor import Tensor
from ipuxl.kernels import debug as kernels
from ipuxl.kernels.poplar_print import FLOAT_FORMATS

__all__ = ["init", "print_tensor"]


def init(shape: Iterable[int], dtype: Any, name: str | None = None,
         init_type: Literal["zero", "undef"] = "zero") -> Tensor:
    """A new tensor of zeros (``"zero"``) or of undefined values (``"undef"``), in any graph.

    Unlike a variable it is not stored between runs: the op makes it each time it runs.
    """
    if init_type not in ("zero", "undef"):
        raise InvalidValueError(f"op 'init': unknown init_type {init_type!r}", where=user_source_line(),
                                fix="use 'zero' or 'undef'")
    dims, torch_dtype = [int(d) for d in shape], from_any(dtype)
    return emit("init", kernels.init, (dims, torch_dtype, init_type == "zero"), name=name,
                meta_fn=lambda *_: torch.empty(dims, dtype=torch_dtype, device="meta"))


def print_tensor(t: Tensor, title: str | None = None, print_self: bool = True, print_gradient: bool = False,
                 summarise_threshold: int = 1000, edge_items: int = 3, max_line_width: int = 75, digits: int = 8,
                 float_format: str = "auto", separator: str = " ", open_bracket: str = "[",
                 close_bracket: str = "]") -> Tensor:
    """Print ``t`` to stderr when the op runs, as ``title: values`` in Poplar's layout; returns a
    copy of ``t``.

    As in PopXL, use the returned tensor (an op whose result nothing reads may be
    removed). ``print_gradient`` also prints the gradient reaching ``t`` when the grad
    graph of ``transforms.autodiff`` runs, titled ``"<title>_gradient"``. Default title:
    ``print_<name of t>``. The format options are Poplar's ``PrintTensorFmt``: more than
    ``summarise_threshold`` elements (0: never) show ``edge_items`` at each edge; lines
    wrap at ``max_line_width``; ``digits`` significant digits in ``float_format``
    (``"auto"``, ``"fixed"``, ``"scientific"``, ``"none"``); the brackets and separator
    are the given strings.
    """
    if float_format not in FLOAT_FORMATS:
        raise InvalidValueError(f"op 'print_tensor': float_format must be one of {FLOAT_FORMATS}, "
                                f"got {float_format!r}", where=user_source_line(), fix="pass one of those names")
    title = title if title is not None else f"print_{t.name}"
    fmt = (int(summarise_threshold), int(edge_items), int(max_line_width), int(digits), float_format,
           str(separator), str(open_bracket), str(close_bracket))
    return emit("print_tensor", kernels.print_tensor, (t, title, bool(print_self), bool(print_gradient), *fmt),
                meta_fn=lambda x, *_: torch.empty_like(x))
