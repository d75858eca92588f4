"""Code loading, and the resource model and report with Streaming Memory."""
from __future__ import annotations

import numpy as np
import pytest
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.device.resources import IpuSpec, estimate, remote_traffic
from ipuxl.errors import InvalidArgumentError, InvalidValueError, OutOfMemoryError, UnsupportedError
from ipuxl.ir.remote import code_loaded_graphs

F32 = ipuxl.float32
KiB, MiB = 1024, 1024 * 1024


def _two_layer_program(code_load: bool):
    """x -> layer_a (3 ops) -> layer_b (1 op), each called once; optionally code-loaded first."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.arange(4, dtype=np.float32), F32, name="x")
        layer_a = ir.create_graph(lambda t: ops.relu(t * 2.0 + 1.0), x)
        layer_b = ir.create_graph(lambda t: t - 3.0, x)
        if code_load:
            ops.remote_code_load(layer_a, "executable")
        (y,) = ops.call(layer_a, x)
        if code_load:
            ops.remote_code_load(layer_b, destination="executable")
        (z,) = ops.call(layer_b, y)
        out = ipuxl.d2h_stream(z.shape, z.dtype, "out")
        ops.host_store(out, z)
    return ir, out, layer_a, layer_b


def test_code_loaded_graphs_compute_the_same_values():
    results = []
    for code_load in (False, True):
        ir, out, *_ = _two_layer_program(code_load)
        with ipuxl.Session(ir, "ipu_model") as session:
            results.append(session.run()[out])
    assert_close(results[1], results[0])
    assert_close(results[0], np.maximum(np.arange(4) * 2.0 + 1.0, 0.0).astype(np.float32) - 3.0)


def test_a_graph_passed_to_create_graph_reaches_the_function_and_loads_code_inside_a_graph():
    """PopXL passes non-tensor create_graph arguments through (here a graph, whose code the
    new graph loads; also a numpy array used as a constant), as its nested code-loading example does."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.variable(np.arange(4, dtype=np.float32), F32, name="x")
        double = ir.create_graph(lambda t: t * 2.0, x)

        def load(g: ipuxl.Graph) -> None:
            assert g is double
            ops.remote_code_load(g, destination="executable")

        loader = ir.create_graph(load, double)
        add_offset = ir.create_graph(lambda t, offset: t + ipuxl.constant(offset), x, np.full(4, 0.5, np.float32))
        with ipuxl.in_sequence():
            ops.call(loader)
            (y,) = ops.call(double, x)
            (z,) = ops.call(add_offset, y)
        out = ipuxl.d2h_stream(z.shape, z.dtype, "out")
        ops.host_store(out, z)
    assert double.name in {g.name for g in code_loaded_graphs(ir)}
    with ipuxl.Session(ir, "ipu_model") as session:
        assert_close(session.run()[out], np.arange(4, dtype=np.float32) * 2.0 + 0.5)


def test_code_of_loaded_graphs_counts_on_chip_only_while_loaded():
    spec = IpuSpec()
    plain = estimate(_two_layer_program(False)[0], spec)
    ir, _, layer_a, layer_b = _two_layer_program(True)
    loaded = estimate(ir, spec)
    a, b = plain.code_bytes_by_graph[layer_a.name], plain.code_bytes_by_graph[layer_b.name]
    assert a > b > 0
    code_load_ops = 2 * spec.code_bytes_per_op  # the two remote_code_load ops are code of the main graph
    # both graphs' code moved off-chip; one region the size of the larger stays on-chip
    assert loaded.code_bytes == plain.code_bytes - a - b + max(a, b) + code_load_ops
    assert (loaded.remote_code_bytes, loaded.loaded_code_bytes, loaded.code_loaded_graphs) == (a + b, a, 2)
    assert loaded.streaming_memory_bytes == a + b
    traffic = remote_traffic(ir, spec)
    assert traffic.code_bytes == a + b and traffic.loaded_bytes == traffic.stored_bytes == 0
    assert "code of 2 code-loaded graphs" in loaded.breakdown()


def test_remote_code_load_errors():
    ir = ipuxl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(lambda t: t + 1.0, ipuxl.TensorSpec((2,), F32))
        with pytest.raises(InvalidValueError, match="The remote_code_load op cannot load the code"):
            ops.remote_code_load(ir.main_graph, "executable")  # the graph being built, as PopXL
    other = ipuxl.Ir()
    with other.main_graph:
        with pytest.raises(InvalidArgumentError, match="needs a subgraph of this Ir"):
            ops.remote_code_load(ir.main_graph, "executable")
    with ir.main_graph:
        # PopXL implements only "executable": the others (and unknown names) are NotImplementedErrors
        with pytest.raises(UnsupportedError, match="'io_buffer' is not supported") as info:
            ops.remote_code_load(graph, "io_buffer")
        assert isinstance(info.value, NotImplementedError)
        with pytest.raises(UnsupportedError, match="'host' is not a code location"):
            ops.remote_code_load(graph, "host")
    with graph:  # PopXL: a ValueError, the op cannot load the graph it is in
        with pytest.raises(InvalidValueError, match="cannot load the code of the graph it is in") as v_info:
            ops.remote_code_load(graph, "executable")
    assert isinstance(v_info.value, ValueError)
    assert graph not in code_loaded_graphs(ir)  # nothing was recorded by the refused calls


def _phased_program(remote: bool, layers: int = 4, width: int = 64, steps: int = 2):
    """``layers`` square weights applied in turn; with ``remote`` they live in Streaming
    Memory and each phase loads its weight, applies it and stores it back (scaled)."""
    ir = ipuxl.Ir()
    ir.num_host_transfers = steps
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((width, width)).astype(np.float32) / width for _ in range(layers)]
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((8, width), F32, "x")
        if remote:
            buffer = ipuxl.remote_buffer((width, width), F32, entries=layers)
            handles = [ipuxl.remote_variable(w, buffer, i, name=f"w{i}") for i, w in enumerate(weights)]
        else:
            handles = [ipuxl.variable(w, F32, name=f"w{i}") for i, w in enumerate(weights)]

        out_stream = ipuxl.d2h_stream((8, width), F32, "out")

        def loop(ws):
            h = ops.host_load(x_stream)
            for i in range(layers):
                if remote:
                    w = ops.remote_load(buffer, i)
                    h = ops.matmul(h, w)
                    ops.remote_store(buffer, i, w * 0.5)
                else:
                    h = ops.matmul(h, ws[i])
                    ops.var_updates.copy_var_update_(ws[i], ws[i] * 0.5)
            ops.host_store(out_stream, h)

        if remote:
            ops.repeat(ir.create_graph(loop, []), steps)
        else:
            ops.repeat(ir.create_graph(loop, [ipuxl.TensorByRef(h) for h in handles]), steps, *handles)
    return ir, x_stream, out_stream, handles, weights


def test_phased_program_fits_where_the_on_chip_one_does_not_and_computes_the_same():
    layers, width, steps = 4, 64, 2
    weight_bytes = width * width * 4
    plain_ir, x_p, out_p, vars_p, weights = _phased_program(False, layers, width, steps)
    remote_ir, x_r, out_r, vars_r, _ = _phased_program(True, layers, width, steps)
    plain, remote = estimate(plain_ir), estimate(remote_ir)
    assert plain.variable_bytes == layers * weight_bytes and remote.variable_bytes == 0
    assert remote.remote_buffer_bytes == layers * weight_bytes
    # a spec between the two on-chip totals: only the phased program fits
    limit = (remote.total_bytes + plain.total_bytes) // 2
    assert remote.total_bytes < limit < plain.total_bytes
    spec = IpuSpec(memory_bytes_override=limit)
    with pytest.raises(OutOfMemoryError, match="does not fit in the memory of one IPU"):
        estimate(plain_ir, spec).check()
    estimate(remote_ir, spec).check()

    data = np.random.default_rng(1).standard_normal((steps, 8, width)).astype(np.float32)
    with ipuxl.Session(plain_ir, "cpu") as session:
        expected = session.run({x_p: data})[out_p]
        expected_w = [session.get_tensor_data(v).copy() for v in vars_p]
    with ipuxl.Session(remote_ir, "cpu") as session:
        got = session.run({x_r: data})[out_r]
        got_w = [session.get_tensor_data(v) for v in vars_r]
    assert_close(got, expected)
    for w_got, w_expected, w0 in zip(got_w, expected_w, weights):
        assert_close(w_got, w_expected)
        assert_close(w_got, w0 * 0.5 ** steps)

    report = ipuxl.Session(remote_ir, "cpu").report()
    step = report.remote_per_step
    assert (step.loaded_bytes, step.stored_bytes) == (layers * weight_bytes, layers * weight_bytes)
    assert report.remote_per_run.loaded_bytes == steps * layers * weight_bytes
    seconds = 2 * layers * weight_bytes / report.memory.spec.streaming_memory_bandwidth
    assert report.exchange_seconds_per_step == pytest.approx(seconds)
    assert report.compute_seconds_per_step == pytest.approx(report.flops_per_step / report.memory.spec.flops_per_second)
    text = str(report)
    assert "Streaming Memory per step" in text and f"{layers * weight_bytes:,} B" in text
    assert "exchange time" in text and "compute estimate" in text and "on-chip peak" in text


def test_streaming_memory_capacity_is_checked():
    ir = ipuxl.Ir()
    with ir.main_graph:
        ipuxl.remote_buffer((1024,), F32, entries=512)  # 2 MiB
    fits = estimate(ir, IpuSpec(streaming_memory_bytes=4 * MiB))
    assert fits.fits and fits.streaming_memory_bytes == 2 * MiB
    with pytest.raises(OutOfMemoryError, match="Streaming Memory does not fit: it needs 2.0 MiB"):
        estimate(ir, IpuSpec(streaming_memory_bytes=1 * MiB)).check()
    with pytest.raises(InvalidArgumentError, match="streaming_memory_bandwidth must be a number > 0"):
        IpuSpec(streaming_memory_bandwidth=0)
