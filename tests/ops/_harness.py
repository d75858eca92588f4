"""A small op-test harness in the style of tinygrad's ``helper_test_op``.

:func:`check_op` builds an ipuxl op inside a subgraph (``ir.create_graph`` over
``TensorSpec`` inputs), calls it from the main graph on host-loaded data, and
compares the outputs, and optionally the gradients of every floating-point input
(``transforms.autodiff`` of the subgraph, grad graph called with a host-loaded
random ``dy``), with eager PyTorch on the same data.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl.dtypes import from_any, to_numpy_dtype

__all__ = ["check_op", "run_op", "randn", "run_main", "as_list", "case", "run_case", "ints", "bools", "pos"]

Shape = tuple[int, ...]
Input = Shape | np.ndarray


def randn(shape: Shape, dtype: Any = np.float64, seed: int = 0, low: float | None = None,
          high: float | None = None) -> np.ndarray:
    """Deterministic host data: normal samples, or uniform in ``[low, high)`` when given."""
    rng = np.random.default_rng(seed)
    if low is not None or high is not None:
        data = rng.uniform(-1.0 if low is None else low, 1.0 if high is None else high, size=shape)
    else:
        data = rng.standard_normal(shape)
    return np.asarray(data).astype(dtype)


def as_list(value: Any) -> list[Any]:
    """Outputs as a list: a single tensor becomes ``[tensor]``."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def run_main(build: Callable[..., dict[str, Any]],
             inputs: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Build ops directly in a main graph, run it once, return what it produced.

    Args:
        build: called as ``build(ir, load)`` inside ``with ir.main_graph``, where
            ``load(name)`` host-loads ``inputs[name]``. Returns ``{key: tensor}``:
            a ``Variable`` is read back after the run (``session.get_tensor_data``),
            any other tensor is host-stored.
        inputs: host data of the loaded streams, by name.

    Returns:
        ``{key: array}``: stored tensors and the final values of returned variables.
    """
    inputs = inputs or {}
    ir = ipuxl.Ir()
    streams: dict[Any, np.ndarray] = {}

    def load(name: str) -> ipuxl.Tensor:
        data = inputs[name]
        stream = ipuxl.h2d_stream(data.shape, from_any(data.dtype), name)
        streams[stream] = data
        return ops.host_load(stream, name)

    with ir.main_graph:
        results = build(ir, load)
        stores = {}
        for key, t in results.items():
            if not isinstance(t, ipuxl.Variable):
                stream = ipuxl.d2h_stream(t.shape, t.dtype, f"out_{key}")
                ops.host_store(stream, t)
                stores[key] = stream
    with ipuxl.Session(ir, "cpu") as session:
        outs = session.run(streams)
        got = {key: outs[stream] for key, stream in stores.items()}
        for key, t in results.items():
            if isinstance(t, ipuxl.Variable):
                got[key] = np.array(session.get_tensor_data(t), copy=True)
    return got


def _make_inputs(inputs: Sequence[Input], dtype: Any, low: float | None, high: float | None,
                 seed: int) -> list[np.ndarray]:
    # np.array, not np.ascontiguousarray, which makes 0-d arrays 1-d.
    return [randn(x, dtype, seed + i, low, high) if isinstance(x, tuple) else np.array(x, order="C")
            for i, x in enumerate(inputs)]


def run_op(ipuxl_fn: Callable[..., Any], arrays: Sequence[np.ndarray], *, grad: bool = True,
           grad_inputs: Sequence[int] | None = None, seed: int = 0) -> dict[str, Any]:
    """Run ``ipuxl_fn`` as a subgraph called from the main graph, and its gradient.

    Args:
        ipuxl_fn: builds the op(s) on ipuxl ``Tensor`` inputs; returns a Tensor or a
            sequence of Tensors. It becomes a subgraph with one input per array.
        arrays: host data of the inputs (host-loaded in the main graph).
        grad: also differentiate the subgraph (``transforms.autodiff``) and call its
            grad graph with one random ``dy`` per floating-point output.
        grad_inputs: indices of the inputs whose gradients are required (default:
            autodiff's default, every floating-point input).
        seed: seed of the random ``dy``.

    Returns:
        ``{"out": [...], "dy": [(output index, dy), ...], "grad": [...],
        "wrt": [input index of each gradient]}`` with host arrays.
    """
    specs = [ipuxl.TensorSpec(a.shape, from_any(a.dtype)) for a in arrays]
    ir = ipuxl.Ir()
    feeds: dict[Any, np.ndarray] = {}

    def load(name: str, data: np.ndarray) -> ipuxl.Tensor:
        stream = ipuxl.h2d_stream(data.shape, from_any(data.dtype), name)
        feeds[stream] = data
        return ops.host_load(stream, name)

    def store(name: str, t: ipuxl.Tensor) -> Any:
        stream = ipuxl.d2h_stream(t.shape, t.dtype, name)
        ops.host_store(stream, t)
        return stream

    def op_graph(*ts: ipuxl.Tensor) -> Any:
        return ipuxl_fn(*ts)

    # All loads come before all stores (see test_host_load_after_host_store).
    with ir.main_graph:
        graph = ir.create_graph(op_graph, *specs)
        fwd = ops.call_with_info(graph, *[load(f"x{i}", a) for i, a in enumerate(arrays)])
        outs = list(fwd.outputs[:len(graph.outputs)])
        dys: list[tuple[int, np.ndarray]] = []
        grads, wrt = [], []
        if grad:
            required = None if grad_inputs is None else [graph.inputs[i] for i in grad_inputs]
            info = ipuxl.transforms.autodiff(graph, grads_required=required)
            wrt = [next(i for i, g in enumerate(graph.inputs) if g is t) for t in info.outputs]
            dy_tensors = []
            for i, t in enumerate(outs):
                if t.dtype.is_floating_point:
                    dy = randn(t.shape, to_numpy_dtype(t.dtype), seed + 1000 + i)
                    dys.append((i, dy))
                    dy_tensors.append(load(f"dy{i}", dy))
            grads = ops.call(info.graph, *dy_tensors, inputs_dict=info.inputs_dict(fwd))
        out_streams = [store(f"y{i}", t) for i, t in enumerate(outs)]
        grad_streams = [store(f"dx{i}", t) for i, t in zip(wrt, grads)]

    with ipuxl.Session(ir, "cpu") as session:
        results = session.run(feeds)
    return {"out": [results[s] for s in out_streams], "dy": dys,
            "grad": [results[s] for s in grad_streams], "wrt": wrt}


def check_op(ipuxl_fn: Callable[..., Any], torch_fn: Callable[..., Any], inputs: Sequence[Input],
             *, grad: bool = True, grad_inputs: Sequence[int] | None = None, dtype: Any = np.float64,
             low: float | None = None, high: float | None = None, atol: float = 1e-7, rtol: float = 1e-7,
             seed: int = 0) -> dict[str, Any]:
    """Compare ``ipuxl_fn`` with ``torch_fn`` on the same inputs, forward and backward.

    Args:
        ipuxl_fn: builds the op(s) on ipuxl ``Tensor`` inputs (see :func:`run_op`).
        torch_fn: the same computation on ``torch.Tensor`` inputs (the oracle).
        inputs: per input, a shape (random ``dtype`` data is made) or an array.
        grad: also compare gradients: those of every floating-point input (of
            ``grad_inputs`` when given), for a random ``dy`` per floating-point output,
            against ``torch.autograd.grad(torch_fn(*xs), xs, dy)``.
        dtype, low, high: data made for shape inputs (``randn``; uniform in
            ``[low, high)`` when a bound is given).
        atol, rtol: tolerances of ``torch.testing.assert_close`` (dtypes must match).
        seed: seed of the data.

    Returns:
        What :func:`run_op` returns (for extra checks).
    """
    arrays = _make_inputs(inputs, dtype, low, high, seed)
    got = run_op(ipuxl_fn, arrays, grad=grad, grad_inputs=grad_inputs, seed=seed)

    float_idx = [i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.floating)]
    wrt = list(grad_inputs) if grad_inputs is not None else float_idx
    xs = [torch.tensor(a, requires_grad=grad and i in wrt) for i, a in enumerate(arrays)]
    expected = as_list(torch_fn(*xs))

    assert len(got["out"]) == len(expected), f"ipuxl gave {len(got['out'])} outputs, torch {len(expected)}"
    for i, (g, e) in enumerate(zip(got["out"], expected)):
        torch.testing.assert_close(torch.from_numpy(np.asarray(g)), e.detach(), atol=atol, rtol=rtol,
                                   equal_nan=True, msg=lambda m, i=i: f"forward output {i}: {m}")
    if grad:
        assert got["wrt"] == wrt, f"autodiff differentiated inputs {got['wrt']}, expected {wrt}"
        pairs = [(expected[i], torch.from_numpy(dy)) for i, dy in got["dy"] if expected[i].requires_grad]
        exp_grads = (torch.autograd.grad([y for y, _ in pairs], [xs[i] for i in wrt], [dy for _, dy in pairs],
                                         allow_unused=True) if pairs else [None] * len(wrt))
        for i, g, e in zip(wrt, got["grad"], exp_grads):
            e = torch.zeros_like(xs[i]) if e is None else e
            torch.testing.assert_close(torch.from_numpy(np.asarray(g)), e, atol=atol, rtol=rtol,
                                       msg=lambda m, i=i: f"gradient of input {i}: {m}")
    return got


def case(id_: str, ipuxl_fn, torch_fn, *inputs, marks=(), **kwargs):
    """One ``check_op`` case for ``pytest.mark.parametrize``."""
    return pytest.param(ipuxl_fn, torch_fn, list(inputs), kwargs, id=id_, marks=marks)


def run_case(ipuxl_fn, torch_fn, inputs, kwargs):
    check_op(ipuxl_fn, torch_fn, inputs, **kwargs)


def ints(shape, low=0, high=3, dtype=np.int32, seed=0):
    return np.random.default_rng(seed).integers(low, high, size=shape).astype(dtype)


def bools(shape, seed=0):
    return np.random.default_rng(seed).random(shape) > 0.5


def pos(shape, seed=0):
    """Positive data away from zero (log, sqrt, pow, divisors)."""
    return randn(shape, seed=seed, low=0.5, high=2.0)
