"""The reductions (``ipuxl.ops.reduce``), forward and gradient, against eager PyTorch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl.ops as ops

from ._harness import case, pos, run_case, run_op

vu = ops.var_updates


def _dims(x, axis):
    return list(range(x.dim())) if axis is None else [axis] if isinstance(axis, int) else list(axis)


def _prod_ref(x, dims, keepdim):
    for d in sorted((d % x.dim() for d in dims), reverse=True):
        x = torch.prod(x, d, keepdim=keepdim)
    return x


REDUCE_FNS = [
    ("sum", ops.sum, lambda x, d, k: torch.sum(x, d, k)),
    ("mean", ops.mean, lambda x, d, k: torch.mean(x, d, k)),
    ("max", ops.max, lambda x, d, k: torch.amax(x, d, k)),
    ("min", ops.min, lambda x, d, k: torch.amin(x, d, k)),
    ("prod", ops.prod, _prod_ref),
    ("sumsquare", ops.sumsquare, lambda x, d, k: torch.sum(x * x, d, k)),
    ("logsumexp", ops.logsumexp, lambda x, d, k: torch.logsumexp(x, d, k)),
    ("l1", ops.l1, lambda x, d, k: torch.sum(torch.abs(x), d, k)),
    ("l2", ops.l2, lambda x, d, k: torch.sqrt(torch.sum(x * x, d, k))),
]


REDUCE = [
    case(f"{name}-axis{axis}-keep{keep}", lambda x, f=fn, a=axis, k=keep: f(x, a, k),
         lambda x, r=ref, a=axis, k=keep: r(x, _dims(x, a), k), (2, 3, 4))
    for name, fn, ref in REDUCE_FNS for axis in (None, 1, -1, [0, 2], [1, -3]) for keep in (False, True)
]

REDUCE += [
    case(f"{alias}-axis{axis}", lambda x, f=getattr(ops, alias), a=axis: f(x, axis=a, keepdims=True),
         lambda x, r=ref, a=axis: r(x, _dims(x, a), True), (2, 3, 4))
    for alias, ref in [("reduce_sum", torch.sum), ("reduce_mean", torch.mean), ("reduce_max", torch.amax),
                       ("reduce_min", torch.amin)]
    for axis in (None, [1, 2])
]

REDUCE += [
    case(f"{name}-dim{dim}-keep{keep}", lambda x, f=fn, d=dim, k=keep: f(x, d, k),
         lambda x, r=ref, d=dim, k=keep: r(x, d, k).to(torch.int32), (3, 4, 5), grad=False)
    for name, fn, ref in [("argmax", ops.argmax, torch.argmax), ("argmin", ops.argmin, torch.argmin)]
    for dim in (0, 1, -1) for keep in (False, True)
]

REDUCE += [
    case("argmax-default", ops.argmax, lambda x: torch.argmax(x, 0).to(torch.int32), (4, 3), grad=False),
    case("lamb_square", ops.lamb_square, lambda x: torch.sum(x.float() * x.float()), (3, 4),
         atol=1e-5, rtol=1e-5),
    case("lamb_square-fp16", ops.lamb_square, lambda x: torch.sum(x.float() ** 2), (3, 4),
         dtype=np.float16, grad=False, atol=1e-5, rtol=1e-5),
    case("lamb_square-var_updates", vu.lamb_square, lambda x: torch.sum(x.float() ** 2), (5,),
         dtype=np.float32, atol=1e-5, rtol=1e-5),
]


def _median_ref(x, dims, keepdim):
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims).reshape(*(x.shape[d] for d in kept), -1)
    out = moved.median(-1).values
    return out.reshape([1 if d in dims else x.shape[d] for d in range(x.dim())]) if keepdim else out


REDUCE += [
    case("logsum", ops.logsum, lambda x: torch.log(x.sum()), pos((3, 4))),
    case("logsum-axis", lambda x: ops.logsum(x, 1, keepdims=True), lambda x: torch.log(x.sum(1, keepdim=True)),
         pos((3, 4))),
    case("logsum-axes", lambda x: ops.logsum(x, [0, 2]), lambda x: torch.log(x.sum((0, 2))), pos((2, 3, 4))),
    case("median-all", ops.median, lambda x: x.reshape(-1).median(), (3, 5)),
    case("median-axis", lambda x: ops.median(x, 1), lambda x: x.median(1).values, (3, 5)),
    case("median-even-lower", lambda x: ops.median(x, -1, keepdims=True), lambda x: x.median(-1, True).values,
         (3, 4)),
    case("median-axes", lambda x: ops.median(x, [0, 2], True), lambda x: _median_ref(x, [0, 2], True), (3, 2, 3)),
    case("cumsum", ops.cumsum, lambda x: torch.cumsum(x, 0), (4, 3)),
    case("cumsum-dim", lambda x: ops.cumsum(x, -1), lambda x: torch.cumsum(x, -1), (4, 3)),
    case("cumsum-int", lambda x: ops.cumsum(x, 1), lambda x: torch.cumsum(x, 1, dtype=torch.int32),
         np.arange(12, dtype=np.int32).reshape(3, 4), grad=False),
]


@pytest.mark.parametrize("ipuxl_fn, torch_fn, inputs, kwargs", REDUCE)
def test_reduce(ipuxl_fn, torch_fn, inputs, kwargs):
    run_case(ipuxl_fn, torch_fn, inputs, kwargs)


def test_reduce_aliases():
    assert (ops.reduce_sum, ops.reduce_mean, ops.reduce_max, ops.reduce_min) == (ops.sum, ops.mean, ops.max, ops.min)


def test_median_even_count_is_the_lower_middle_value():
    out = run_op(ops.median, [np.array([4.0, 1.0, 3.0, 2.0])], grad=False)["out"][0]
    assert out == 2.0  # numpy.median would give 2.5
