"""Meta shapes through ``Tensor.spec``, autodiff refusing Streaming Memory ops, and calls of
code-loaded graphs before their load (PopXL semantics)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl import transforms
from ipuxl.device.resources import IpuSpec, estimate
from ipuxl.errors import AutodiffError

F32 = ipuxl.float32


def _shard(full: np.ndarray, index: int, over: int) -> np.ndarray:
    flat = full.reshape(-1)
    size = -(-flat.size // over)
    padded = np.concatenate([flat, np.zeros(size * over - flat.size, flat.dtype)])
    return padded[index * size:(index + 1) * size]


# -- 1. Tensor.spec keeps meta_shape -------------------------------------------------------------
def test_spec_of_a_sharded_tensor_keeps_its_meta_shape():
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        _, shard = ipuxl.replica_sharded_variable(np.zeros((3, 5), np.float32), name="w")
        plain = ipuxl.variable(np.zeros(8, np.float32), name="p")
    assert shard.spec == ipuxl.TensorSpec((8,), F32, (3, 5))
    assert shard.spec.meta_shape == (3, 5) and dict(shard.spec)["meta_shape"] == (3, 5)
    assert "meta_shape=(3, 5)" in repr(shard.spec)
    # same shape and dtype, different meta shape: different specs, same data layout
    assert plain.spec != shard.spec and plain.spec.same_data(shard.spec)
    assert plain.spec.meta_shape == () and "meta_shape" not in repr(plain.spec)


def test_create_graph_from_a_sharded_tensor_keeps_the_meta_shape_and_gathers_the_whole():
    """``ir.create_graph(fn, shard)`` (no hand-made TensorSpec): the input has the meta shape,
    so ``replicated_all_gather`` in the graph restores the full tensor on each replica."""
    full = np.arange(15, dtype=np.float32).reshape(3, 5)
    ir = ipuxl.Ir(replication=2)
    with ir.main_graph:
        _, shard = ipuxl.replica_sharded_variable(full, name="w")
        graph = ir.create_graph(lambda s: ops.collectives.replicated_all_gather(s) * 2.0, shard)
        assert graph.inputs[0].meta_shape == (3, 5) and graph.inputs[0].spec == shard.spec
        (gathered,) = ops.call(graph, shard)
        shard_out = ipuxl.d2h_stream(shard.shape, shard.dtype, "shard")  # spec without meta_shape
        ops.host_store(shard_out, shard)  # a sharded tensor stores to it: the meta shape is no data
        out = ipuxl.d2h_stream(gathered.shape, gathered.dtype, "out")
        ops.host_store(out, gathered)
    assert gathered.shape == (3, 5)
    with ipuxl.Session(ir, "cpu") as session:
        got = session.run()
    for r in range(2):
        assert_close(got[out][r], full * 2.0)
        assert_close(got[shard_out][r], _shard(full, r, 2))


def test_a_graph_with_a_sharded_input_is_called_and_repeated_with_plain_tensors():
    """Call and repeat compare shape and dtype only, as PopXL: the meta shape is an annotation."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        spec = ipuxl.TensorSpec((4,), F32, (2, 2))
        graph = ir.create_graph(lambda t: t + 1.0, spec)
        x = ipuxl.variable(np.arange(4, dtype=np.float32), name="x")
        (y,) = ops.call(graph, x)
        (z,) = ops.repeat(graph, 3, y)  # the output has no meta shape, the carried input has one
        out = ipuxl.d2h_stream(z.shape, z.dtype, "out")
        ops.host_store(out, z)
    with ipuxl.Session(ir, "cpu") as session:
        assert_close(session.run()[out], np.arange(4, dtype=np.float32) + 4.0)


# -- 2. autodiff refuses Streaming Memory ops ------------------------------------------------------
def _remote_program(kind: str):
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2, 3), F32, 1)
        ipuxl.remote_variable(np.ones((2, 3), np.float32), buffer, 0, name="w")
        inner = ir.create_graph(lambda t: t * 3.0, ipuxl.TensorSpec((2, 3), F32))

        def forward(x):
            if kind == "remote_load":
                return x * ops.remote_load(buffer, 0)
            if kind == "remote_load_":
                return x * ops.remote_load_(x * 0.0, buffer, 0)
            if kind == "remote_store":
                ops.remote_store(buffer, 0, x)
                return x * x
            if kind == "remote_code_load":
                ops.remote_code_load(inner, "executable")
                return x * x
            sub = ir.create_graph(lambda t: t * ops.remote_load(buffer, 0), x)  # "nested"
            (y,) = ops.call(sub, x)
            return y

        graph = ir.create_graph(forward, ipuxl.TensorSpec((2, 3), F32))
    return graph


@pytest.mark.parametrize("kind", ["remote_load", "remote_load_", "remote_store", "remote_code_load", "nested"])
def test_autodiff_refuses_a_graph_with_streaming_memory_ops(kind):
    graph = _remote_program(kind)
    with pytest.raises(AutodiffError) as info:
        transforms.autodiff(graph)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    op = "remote_load" if kind == "nested" else kind
    assert f"contains {op} (" in message and f"autodiff of graph '{graph.name}'" in message
    assert "load in the caller and pass the loaded tensor" in message
    assert "test_streaming_memory_limits.py" in message  # where: the user's line of the op
    if kind == "nested":
        assert "called from" in message


def test_the_phased_pattern_differentiates_a_graph_fed_by_a_load_in_the_caller():
    """The fix the error names: load in the caller, pass the tensor in, store the update back."""
    w0 = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
    x0 = np.array([[2.0, 1.0]], np.float32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        buffer = ipuxl.remote_buffer((2, 2), F32, 1)
        w_var = ipuxl.remote_variable(w0, buffer, 0, name="w")
        x = ipuxl.constant(x0)
        graph = ir.create_graph(lambda w, a: ops.sum((a @ w) * (a @ w)), ipuxl.TensorSpec((2, 2), F32), x)
        info = transforms.autodiff(graph, grads_required=[graph.inputs[0]])
        w = ops.remote_load(buffer, 0)
        fwd = ops.call_with_info(graph, w, x)
        (dw,) = ops.call(info.graph, ipuxl.constant(np.ones((), np.float32)), inputs_dict=info.inputs_dict(fwd))
        ops.remote_store(buffer, 0, w - dw * 0.1)
    with ipuxl.Session(ir, "cpu") as session:
        session.run()
        got = session.get_tensor_data(w_var)
    wt = torch.tensor(w0, requires_grad=True)
    (grad,) = torch.autograd.grad(((torch.tensor(x0) @ wt) ** 2).sum(), wt)
    assert_close(torch.as_tensor(got), (wt - 0.1 * grad).detach())


# -- 3. code-loaded graphs called before their load ----------------------------------------------
def _called_then_loaded(load_first: bool):
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.arange(4, dtype=np.float32), F32, name="x")
        layer = ir.create_graph(lambda t: ops.relu(t * 2.0 - 3.0), x)
        if load_first:
            ops.remote_code_load(layer, "executable")
        (y,) = ops.call(layer, x)
        if not load_first:
            ops.remote_code_load(layer, "executable")
        (z,) = ops.call(layer, y)
        out = ipuxl.d2h_stream(z.shape, z.dtype, "out")
        ops.host_store(out, z)
    return ir, out, layer


def test_calling_a_code_loaded_graph_before_its_load_runs_as_in_popxl():
    """PopXL makes the order the user's responsibility (no error): the values are those of the
    plain program, and the resource model counts the graph as code-loaded either way."""
    results, code = [], []
    for load_first in (True, False):
        ir, out, layer = _called_then_loaded(load_first)
        with ipuxl.Session(ir, "ipu_model") as session:
            results.append(session.run()[out])
        code.append(estimate(ir, IpuSpec()).code_loaded_graphs)
    expected = np.maximum(np.maximum(np.arange(4) * 2.0 - 3.0, 0.0) * 2.0 - 3.0, 0.0).astype(np.float32)
    assert_close(results[0], expected)
    assert_close(results[1], expected)
    assert code == [1, 1]
