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
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl.dtypes import from_any, to_numpy_dtype

__all__ = ["check_op", "randn", "run_main", "as_list"]

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


def check_op(ipuxl_fn: Callable[..., Any], torch_fn: Callable[..., Any], inputs: Sequence[Input],
             *, grad: bool = True, grad_inputs: Sequence[int] | None = None, dtype: Any = np.float64,
             low: float | None = None, high: float | None = None, atol: float = 1e-7, rtol: float = 1e-7,
             seed: int = 0) -> dict[str, list[np.ndarray]]:
    """Compare ``ipuxl_fn`` with ``torch_fn`` on the same inputs, forward and backward.

    Args:
        ipuxl_fn: builds the op(s) on ipuxl ``Tensor`` inputs; returns a Tensor or a
            sequence of Tensors.
        torch_fn: the same computation on ``torch.Tensor`` inputs (the oracle).
        inputs: per input, a shape (random ``dtype`` data is made) or an array.
        grad: also compare gradients of the floating-point inputs (of ``grad_inputs``
            when given, indices into ``inputs``) for a random upstream ``dy`` per
            floating-point output.
        dtype, low, high: data made for shape inputs (``randn``; uniform in
            ``[low, high)`` when a bound is given).
        atol, rtol: tolerances of ``torch.testing.assert_close``.
        seed: seed of the data.

    Returns:
        ``{"out": [...], "grad": [...]}`` host arrays from ipuxl (for extra checks).
    """
    arrays = [np.ascontiguousarray(randn(x, dtype, seed + i, low, high) if isinstance(x, tuple) else x)
              for i, x in enumerate(inputs)]
    specs = [ipuxl.TensorSpec(a.shape, from_any(a.dtype)) for a in arrays]
    float_idx = [i for i, s in enumerate(specs) if s.dtype.is_floating_point]
    wrt = list(grad_inputs) if grad_inputs is not None else float_idx

    # -- eager torch oracle ---------------------------------------------------------------
    xs = [torch.tensor(a, requires_grad=grad and i in wrt) for i, a in enumerate(arrays)]
    expected = as_list(torch_fn(*xs))

    # -- ipuxl program ----------------------------------------------------------------------
    ir = ipuxl.Ir()
    feeds: dict[Any, np.ndarray] = {}

    def load(name: str, data: np.ndarray) -> ipuxl.Tensor:
        stream = ipuxl.h2d_stream(data.shape, from_any(data.dtype), name)
        feeds[stream] = data
        return ops.host_load(stream, name)

    with ir.main_graph:
        def op_graph(*ts: ipuxl.Tensor) -> Any:
            return ipuxl_fn(*ts)

        graph = ir.create_graph(op_graph, *specs)
        loaded = [load(f"x{i}", a) for i, a in enumerate(arrays)]
        fwd = ops.call_with_info(graph, *loaded)
        n_out = len(graph.outputs)
        outs = list(fwd.outputs[:n_out])
        stored = []
        for i, t in enumerate(outs):
            stream = ipuxl.d2h_stream(t.shape, t.dtype, f"y{i}")
            ops.host_store(stream, t)
            stored.append(stream)
        grad_streams, dys = [], []
        if grad:
            info = ipuxl.transforms.autodiff(graph, grads_required=[graph.inputs[i] for i in wrt])
            float_outs = [i for i in range(n_out) if outs[i].dtype.is_floating_point]
            dy_tensors = []
            for k, i in enumerate(float_outs):
                dy = randn(outs[i].shape, to_numpy_dtype(outs[i].dtype), seed + 1000 + k)
                dys.append((i, dy))
                dy_tensors.append(load(f"dy{i}", dy))
            grads = ops.call(info.graph, *dy_tensors, inputs_dict=info.inputs_dict(fwd))
            for k, t in enumerate(grads):
                stream = ipuxl.d2h_stream(t.shape, t.dtype, f"dx{wrt[k]}")
                ops.host_store(stream, t)
                grad_streams.append(stream)

    with ipuxl.Session(ir, "cpu") as session:
        results = session.run(feeds)

    got = [results[s] for s in stored]
    assert len(got) == len(expected), f"ipuxl gave {len(got)} outputs, torch {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(torch.from_numpy(np.asarray(g)), e.detach(), atol=atol, rtol=rtol,
                                   equal_nan=True, msg=lambda m, i=i: f"forward output {i}: {m}")
    got_grads = [results[s] for s in grad_streams]
    if grad:
        assert wrt, "grad=True but no floating-point input to differentiate"
        targets = [expected[i] for i, _ in dys]
        targets_dy = [torch.from_numpy(dy) for _, dy in dys]
        exp_grads = torch.autograd.grad(targets, [xs[i] for i in wrt], targets_dy, allow_unused=True)
        assert len(got_grads) == len(wrt)
        for k, (g, e) in enumerate(zip(got_grads, exp_grads)):
            e = torch.zeros_like(xs[wrt[k]]) if e is None else e
            torch.testing.assert_close(torch.from_numpy(np.asarray(g)), e, atol=atol, rtol=rtol,
                                       msg=lambda m, k=k: f"gradient of input {wrt[k]}: {m}")
    return {"out": got, "grad": got_grads}
