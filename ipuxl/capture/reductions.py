"""Product scatters with a gradient that traces: ``scatter_reduce`` / ``index_reduce``
with ``reduce="prod"`` in a training model.

Their outputs have static shapes, but torch's backward formula for them branches on
tensor values (whether a group holds zeros), which make_fx cannot trace. While a
training model is captured, ``static_prod`` computes them instead as a product over
a one-hot expansion: for output row ``m``, the sources whose index is ``m`` and
ones elsewhere, multiplied along the source axis. ``torch.prod``'s backward traces
(zeros included), so the gradient is exact; the cost is one tensor of
``rows x sources`` elements. Inference keeps torch's own kernels.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["static_prod", "NOT_PROD"]

NOT_PROD = object()  # static_prod's answer for any other call


def static_prod(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` computed as described above when it is a product
    ``scatter_reduce``/``index_reduce`` (not in place), else ``NOT_PROD``."""
    name = getattr(func, "__name__", "")
    if name not in ("scatter_reduce", "index_reduce"):
        return NOT_PROD
    keys = ("input", "dim", "index", "src", "reduce") if name == "scatter_reduce" else \
        ("input", "dim", "index", "source", "reduce")
    a = dict(zip(keys, args), **kwargs)
    a.setdefault("input", a.pop("self", None))
    if a.get("reduce") != "prod" or a.get("out") is not None:
        return NOT_PROD
    source = a["src"] if name == "scatter_reduce" else a["source"]
    include_self = a.get("include_self", True)
    if name == "scatter_reduce":
        return _scatter_prod(a["input"], a["dim"], a["index"], source, include_self)
    return _index_prod(a["input"], a["dim"], a["index"], source, include_self)


def _combine(base: torch.Tensor, product: torch.Tensor, hits: torch.Tensor, include_self: bool) -> torch.Tensor:
    """Positions with at least one source take their product (times ``base`` when
    ``include_self``); the others keep ``base``."""
    product = product.to(base.dtype)
    return torch.where(hits > 0, base * product if include_self else product, base)


def _scatter_prod(base: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor,
                  include_self: bool) -> torch.Tensor:
    dim = dim % base.dim()
    rows = base.shape[dim]
    src = src[tuple(slice(0, n) for n in index.shape)]  # only index's extent of src is scattered
    row = torch.arange(rows, device=index.device).view(rows, *([1] * index.dim()))
    hit = index.unsqueeze(0) == row                                   # [rows, *index.shape]
    product = torch.where(hit, src.unsqueeze(0), torch.ones_like(src).unsqueeze(0)).prod(dim + 1)
    hits = hit.sum(dim + 1)
    product, hits = product.movedim(0, dim), hits.movedim(0, dim)      # index.shape, dim -> rows
    pad: list[int] = []
    for axis in reversed(range(base.dim())):                           # other axes may be shorter than base's
        pad += [0, base.shape[axis] - product.shape[axis]]
    product = torch.nn.functional.pad(product, pad, value=1.0)
    hits = torch.nn.functional.pad(hits, pad, value=0)
    return _combine(base, product, hits, include_self)


def _index_prod(base: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor,
                include_self: bool) -> torch.Tensor:
    dim = dim % base.dim()
    rows = base.shape[dim]
    moved = source.movedim(dim, 0)                                     # [sources, *rest]
    hit = index.view(1, -1) == torch.arange(rows, device=index.device).view(rows, 1)  # [rows, sources]
    mask = hit.view(*hit.shape, *([1] * (moved.dim() - 1)))
    product = torch.where(mask, moved.unsqueeze(0), torch.ones_like(moved).unsqueeze(0)).prod(1)
    hits = hit.sum(1).view(rows, *([1] * (moved.dim() - 1)))
    return _combine(base, product.movedim(0, dim), hits.movedim(0, dim), include_self)
