"""The device keeps matmul weights whose rows alias in the cache in padded rows
(``ipuxl.device.layout``): the program's values are eager PyTorch's, whatever the layout.

Each PopXL program below trains a weight ``W`` for a few steps in a device loop
(``ops.repeat`` of a step that loads its batch); the oracle is the same arithmetic in
eager PyTorch. The layout itself is checked on the session's device tensor: padded
(row stride ``cols + 16`` for float32) only where every use is a matmul, a transpose
or an in-place update, contiguous otherwise, so an in-place update through a view
is never lost in a copy.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.device.layout import PAD_BYTES, needs_padding, padded_like

STEPS, BATCH, LR = 3, 8, 0.05


def _device_tensor(session: ipuxl.Session, var: ipuxl.Tensor, replica: int = 0) -> torch.Tensor:
    return session._replica_vars[replica][var.name]


def _is_padded(tensor: torch.Tensor) -> bool:
    return tensor.stride() == (tensor.shape[1] + PAD_BYTES // tensor.element_size(), 1)


def _data(rows: int, cols: int, replicas: int = 1):
    g = torch.Generator().manual_seed(0)
    w0 = (torch.randn(rows, cols, generator=g) * 0.02).numpy()
    shape = (STEPS, replicas, BATCH, rows) if replicas > 1 else (STEPS, BATCH, rows)
    xs = torch.randn(shape, generator=g).numpy()
    return w0, xs


def _sgd_program(w0: np.ndarray, body, replicas: int = 1, call_sites: int = 1):
    """A device loop of ``STEPS`` steps: ``y = x @ W``, store ``y``, then ``body(W, x, y)``
    updates ``W``; with ``call_sites`` 2 the product is a subgraph called twice."""
    rows, cols = w0.shape
    ir = ipuxl.Ir()
    ir.num_host_transfers = STEPS
    ir.replication_factor = replicas
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((BATCH, rows), ipuxl.float32, name="x")
        y_stream = ipuxl.d2h_stream((BATCH, cols), ipuxl.float32, name="y")
        W = ipuxl.variable(w0, name="W")

        def product(x: ipuxl.Tensor, w: ipuxl.Tensor) -> ipuxl.Tensor:
            return x @ w

        def step(w: ipuxl.Tensor) -> None:
            x = ops.host_load(x_stream, "x")
            if call_sites == 1:
                y = x @ w
            else:
                graph = ir.create_graph(product, x, w)
                y = ops.call(graph, x, w)[0] + ops.call(graph, x, w)[0]
            ops.host_store(y_stream, y)
            body(w, x, y)

        ops.repeat(ir.create_graph(step, ipuxl.TensorByRef(W)), STEPS, W)
    return ir, x_stream, y_stream, W


def _sgd_update(w, x, y):
    """``W -= lr * x.T @ y`` (the gradient of ``sum(y ** 2) / 2``): fused to one addmm_."""
    ops.scaled_add_(w, x.T @ y, b=-LR)


def _eager(w0: np.ndarray, xs: np.ndarray, call_sites: int = 1, reduce: bool = False):
    w = torch.from_numpy(w0.copy())
    ys = []
    for x in torch.from_numpy(xs):
        if reduce:  # replicas: each its own batch, the gradient summed over replicas
            y = x @ w * call_sites
            ys.append(y)
            w -= LR * sum(xr.T @ yr for xr, yr in zip(x, y))
            continue
        y = x @ w * call_sites
        ys.append(y)
        w -= LR * (x.T @ y)
    return w, torch.stack(ys)


@pytest.mark.parametrize("rows, cols", [(784, 512), (512, 512), (512, 64)])
def test_matmul_weight_is_padded_and_trains_as_eager(rows, cols):
    w0, xs = _data(rows, cols)
    ir, x_stream, y_stream, W = _sgd_program(w0, _sgd_update)
    with ipuxl.Session(ir, "cpu") as session:
        ys = session.run({x_stream: xs})[y_stream]
        assert _is_padded(_device_tensor(session, W))
        got = session.get_tensor_data(W)
    w, ys_eager = _eager(w0, xs)
    assert_close(torch.from_numpy(ys), ys_eager, rtol=1e-5, atol=1e-5)
    assert_close(torch.from_numpy(got), w, rtol=1e-5, atol=1e-5)
    assert got.shape == (rows, cols) and got.flags.c_contiguous


def test_weight_used_by_a_subgraph_called_twice_is_padded():
    w0, xs = _data(512, 512)
    ir, x_stream, y_stream, W = _sgd_program(w0, _sgd_update, call_sites=2)
    with ipuxl.Session(ir, "cpu") as session:
        ys = session.run({x_stream: xs})[y_stream]
        assert _is_padded(_device_tensor(session, W))
        got = session.get_tensor_data(W)
    w, ys_eager = _eager(w0, xs, call_sites=2)
    assert_close(torch.from_numpy(ys), ys_eager, rtol=1e-4, atol=1e-4)  # the steps double y: larger values
    assert_close(torch.from_numpy(got), w, rtol=1e-4, atol=1e-5)


def test_padded_weight_takes_written_data_and_keeps_training():
    w0, xs = _data(512, 512)
    ir, x_stream, _, W = _sgd_program(w0, _sgd_update)
    new = (np.arange(512 * 512, dtype=np.float32).reshape(512, 512) % 7) * 1e-3
    with ipuxl.Session(ir, "cpu") as session:
        session.write_variable_data(W, new)
        assert_close(torch.from_numpy(session.get_tensor_data(W).copy()), torch.from_numpy(new))
        session.run({x_stream: xs})
        assert _is_padded(_device_tensor(session, W))
        got = session.get_tensor_data(W)
    w, _ = _eager(new, xs)
    assert_close(torch.from_numpy(got), w, rtol=1e-5, atol=1e-5)


def test_replicas_pad_each_copy_and_train_as_eager():
    w0, xs = _data(512, 512, replicas=2)

    def reduced_update(w, x, y):
        ops.scaled_add_(w, ops.collectives.replicated_all_reduce(x.T @ y), b=-LR)

    ir, x_stream, _, W = _sgd_program(w0, reduced_update, replicas=2)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({x_stream: xs})
        assert all(_is_padded(_device_tensor(session, W, r)) for r in range(2))
        assert_close(_device_tensor(session, W, 0), _device_tensor(session, W, 1), rtol=0, atol=0)
        got = session.get_tensor_data(W)
    w, _ = _eager(w0, xs, reduce=True)
    assert_close(torch.from_numpy(got), w, rtol=1e-5, atol=1e-5)


def _read_through_reshape(w, x, y):
    """Reads ``W`` through a reshape (a copy if ``W`` were padded): ``W *= 0.5``."""
    ops.scaled_add_(w, x.T @ y, b=-LR)
    ops.scaled_add_(w, w.reshape((512 * 512,)).reshape((512, 512)), b=-0.5)


def _update_through_reshaped_view(w, x, y):
    """Writes ``W`` through ``reshape_`` (a copy if ``W`` were padded: the update would be lost): ``W *= 1.5``."""
    ops.scaled_add_(w, x.T @ y, b=-LR)
    flat = ops.reshape_(w, (512 * 512,))
    ops.scaled_add_(flat, flat * 0.5)


@pytest.mark.parametrize("body, factor", [(_read_through_reshape, 0.5), (_update_through_reshaped_view, 1.5)])
def test_weight_used_through_a_reshape_stays_contiguous_and_updates_reach_it(body, factor):
    w0, xs = _data(512, 512)
    ir, x_stream, _, W = _sgd_program(w0, body)
    with ipuxl.Session(ir, "cpu") as session:
        session.run({x_stream: xs})
        assert _device_tensor(session, W).is_contiguous()
        got = session.get_tensor_data(W)
    w = torch.from_numpy(w0.copy())
    for x in torch.from_numpy(xs):
        w -= LR * (x.T @ (x @ w))
        w *= factor
    assert_close(torch.from_numpy(got), w, rtol=1e-5, atol=1e-5)


def test_poptorch_parameters_keep_their_own_storage():
    """``trainingModel`` binds the module's parameters as the device storage: never padded."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 10))
    loss_fn = torch.nn.CrossEntropyLoss()

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x, y):
            out = self.model(x)
            return out, loss_fn(out, y)

    wrapped = WithLoss()
    pointers = [p.data_ptr() for p in wrapped.parameters()]
    training = ipuxl.trainingModel(wrapped, optimizer=torch.optim.SGD(wrapped.parameters(), lr=0.01))
    training(torch.randn(4, 512), torch.randint(0, 10, (4,)))
    training.copyWeightsToHost()
    assert [p.data_ptr() for p in wrapped.parameters()] == pointers
    assert all(p.is_contiguous() for p in wrapped.parameters())


@pytest.mark.parametrize("shape, dtype, expected", [
    ((512, 512), torch.float32, True),
    ((784, 512), torch.float32, True),
    ((512, 784), torch.float32, False),   # rows 3136 bytes apart: no aliasing
    ((512, 10), torch.float32, False),
    ((64, 128), torch.float32, False),    # small: in the cache anyway
    ((1024, 512), torch.float16, True),   # 1 KiB rows
    ((512, 512), torch.int32, False),     # not a float matrix
    ((8, 64, 64), torch.float32, False),  # not a matrix
])
def test_which_matrices_need_padding(shape, dtype, expected):
    assert needs_padding(torch.zeros(shape, dtype=dtype)) is expected


def test_padded_copy_has_the_values_and_padded_rows():
    tensor = torch.randn(512, 256)
    padded = padded_like(tensor)
    assert padded.shape == tensor.shape and padded.stride() == (256 + PAD_BYTES // 4, 1)
    assert_close(padded, tensor, rtol=0, atol=0)
