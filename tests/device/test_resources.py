"""The IPU resource model: per-IPU memory breakdown, code size of outlined vs inlined
programs, and ``Session(ir, "ipu_model")`` refusing programs that do not fit."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import numpy as np
import pytest

import ipuxl
import ipuxl.ops as ops
from ipuxl.device import resources
from ipuxl.device.resources import IpuSpec, estimate, use_spec
from ipuxl.errors import DeviceError, InvalidArgumentError, OutOfMemoryError

F32 = ipuxl.float32
KiB, MiB = 1024, 1024 * 1024
SPEC = IpuSpec()  # the default spec, whatever the environment says
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the demo model (benchmarks/program_report.py) lives outside the package


def small_program(replication: int = 1) -> ipuxl.Ir:
    """x (16, 256) -> gelu(x @ w + b) (16, 128) -> host. Numbers by hand in the tests."""
    ir = ipuxl.Ir(replication=replication)
    with ir.main_graph:
        x = ops.host_load(ipuxl.h2d_stream((16, 256), F32, "x"))
        w = ipuxl.variable(np.zeros((256, 128), np.float32), name="w")
        b = ipuxl.variable(np.zeros(128, np.float32), name="b")
        h = x @ w                 # 8 KiB
        y = h + b                 # 8 KiB, h freed after
        z = ops.gelu(y)           # 8 KiB, y freed after
        ops.host_store(ipuxl.d2h_stream((16, 128), F32, "z"), z)
    return ir


def test_default_spec_is_an_mk2_ipu():
    spec = IpuSpec()
    assert (spec.tiles, spec.bytes_per_tile) == (1472, 624 * KiB)
    assert spec.memory_bytes == 1472 * 624 * KiB
    assert round(spec.memory_bytes / MiB) == 897
    assert spec.code_bytes_per_op == 8 * KiB and spec.code_bytes_per_call_site == 256


def test_breakdown_of_a_hand_computed_program():
    result = estimate(small_program(), SPEC)
    assert result.variable_bytes == 256 * 128 * 4 + 128 * 4
    assert result.num_variables == 2
    assert result.constant_bytes == 0
    assert result.stream_bytes == 16 * 256 * 4 + 16 * 128 * 4
    assert result.num_streams == 2
    # ops: host_load, matmul, add, gelu, host_store
    assert result.code_ops == 5 and result.outlined_call_sites == 0
    assert result.code_bytes == 5 * 8 * KiB
    # peak: two (16, 128) float32 tensors live at once (h and y at the add, y and z at the gelu)
    assert result.activation_bytes == 2 * 16 * 128 * 4
    assert "op 'add'" in result.peak_op
    assert result.total_bytes == (131584 + 24576 + 40 * KiB + 16 * KiB)
    assert result.fits and result.available_bytes == SPEC.memory_bytes


def test_replicated_program_is_reported_per_ipu():
    one, four = estimate(small_program(), SPEC), estimate(small_program(replication=4), SPEC)
    assert four.replication_factor == 4
    assert (four.variable_bytes, four.stream_bytes, four.activation_bytes, four.code_bytes) == \
        (one.variable_bytes, one.stream_bytes, one.activation_bytes, one.code_bytes)
    assert "one replica per IPU" in four.summary()


def test_called_graph_peak_adds_while_the_call_runs():
    ir = ipuxl.Ir()

    def body(a):
        return ops.gelu(a * 2.0)  # (8, 8): two 256-byte tensors live at the gelu

    with ir.main_graph:
        x = ops.host_load(ipuxl.h2d_stream((8, 8), F32, "x"))
        graph = ir.create_graph(body, x)
        (y,) = ops.call(graph, x)
        (y,) = ops.call(graph, y)
        ops.host_store(ipuxl.d2h_stream((8, 8), F32, "y"), y)
    result = estimate(ir, SPEC)
    # main: host_load, host_store; body once: mul, gelu; two calls of an outlined graph
    assert result.code_ops == 4 and result.outlined_call_sites == 2
    assert result.code_bytes == 4 * 8 * KiB + 2 * 256
    assert result.activation_bytes >= 2 * 256 + 256  # callee peak on top of a live caller tensor
    assert f"the call of '{graph.name}'" in result.peak_op


def test_graph_with_one_call_site_is_inlined_and_unused_graphs_cost_nothing():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ops.host_load(ipuxl.h2d_stream((4,), F32, "x"))
        once = ir.create_graph(lambda a: ops.gelu(a + 1.0), x)
        ir.create_graph(lambda a: a * 3.0 - 1.0, x)  # never called
        (y,) = ops.call(once, x)
        ops.host_store(ipuxl.d2h_stream((4,), F32, "y"), y)
    result = estimate(ir, SPEC)
    assert result.code_ops == 2 + 2 and result.outlined_call_sites == 0
    assert result.code_bytes == 4 * 8 * KiB


# -- configuration ----------------------------------------------------------------------------
def test_spec_from_setter_env_and_argument(monkeypatch):
    monkeypatch.delenv("IPUXL_IPU_MEMORY_MIB", raising=False)
    small = IpuSpec(tiles=4, bytes_per_tile=KiB)
    with use_spec(small):
        assert resources.get_spec() is small
        assert estimate(small_program()).spec is small
    assert resources.get_spec() == resources.DEFAULT_SPEC
    monkeypatch.setenv("IPUXL_IPU_MEMORY_MIB", "2.5")
    monkeypatch.setenv("IPUXL_IPU_CODE_BYTES_PER_OP", "100")
    spec = resources.get_spec()
    assert spec.memory_bytes == int(2.5 * MiB) and spec.code_bytes_per_op == 100
    assert estimate(small_program()).code_bytes == 500
    assert estimate(small_program(), SPEC).code_bytes == 5 * 8 * KiB  # an explicit spec wins
    monkeypatch.setenv("IPUXL_IPU_MEMORY_MIB", "lots")
    with pytest.raises(InvalidArgumentError, match="IPUXL_IPU_MEMORY_MIB"):
        resources.get_spec()
    with pytest.raises(InvalidArgumentError):
        IpuSpec(tiles=-1)


# -- out of memory ------------------------------------------------------------------------------
def wide_program(batch: int) -> ipuxl.Ir:
    """x (batch, 1024) @ w (1024, 1024: 4 MiB) -> gelu -> sum -> host."""
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ops.host_load(ipuxl.h2d_stream((batch, 1024), F32, "x"))
        w = ipuxl.variable(np.zeros((1024, 1024), np.float32), name="w")
        z = ops.gelu(x @ w)
        s = ops.sum(z)
        ops.host_store(ipuxl.d2h_stream((), F32, "s"), s)
    return ir


def test_program_too_big_for_the_ipu_model_raises_with_breakdown(monkeypatch):
    monkeypatch.delenv("IPUXL_IPU_MEMORY_MIB", raising=False)
    spec = IpuSpec(tiles=12, bytes_per_tile=1 * MiB)  # 12 MiB
    with use_spec(spec):
        with pytest.raises(OutOfMemoryError) as info:
            ipuxl.Session(wide_program(1024), "ipu_model")
        err = info.value
        assert isinstance(err, DeviceError) and isinstance(err, MemoryError) and isinstance(err, RuntimeError)
        message = str(err)
        # batch 1024: activations 2 x 4 MiB (x @ w and its gelu), variables 4 MiB, x stream 4 MiB + 4 B,
        # code 5 ops x 8 KiB: 16.0 MiB of 12.0 MiB
        for fragment in ["does not fit", "16.0 MiB", "12.0 MiB (12 tiles x 1024 KiB)", "variables:", "1 tensor,", "4.0 MiB", "peak activations:",
                         "8.0 MiB", "op 'gelu'", "stream buffers:", "code:", "5 op instances", "total:",
                         "Session(Ir[", "'ipu_model'", "recompute", "smaller micro-batch", "'cpu'"]:
            assert fragment in message, f"{fragment!r} not in:\n{message}"
        # what would help, largest part first: activations before variables, code last
        assert message.index("recompute") < message.index("replicated tensor sharding")
        assert "outline" not in message  # code is 40 KiB of 16 MiB: outlining would not help
        # a smaller batch fits and runs
        ir = wide_program(256)
        with ipuxl.Session(ir, "ipu_model") as session:
            out = session.run({ir.get_all_h2d_streams()[0]: np.ones((256, 1024), np.float32)})
        assert float(out[ir.get_all_d2h_streams()[0]]) == 0.0
        # cpu and ipu_hw have no limit
        ipuxl.Session(wide_program(1024), "cpu")
    monkeypatch.setenv("IPUXL_IPU_MEMORY_MIB", "12")
    with pytest.raises(OutOfMemoryError, match="16.0 MiB"):
        ipuxl.Session(wide_program(1024), "ipu_model")


# -- code size: outlined vs inlined ------------------------------------------------------------
def block_program(blocks: int, style: str) -> ipuxl.Ir:
    """``blocks`` blocks gelu(x @ w_i + 1): "outlined" (one graph called per block), "graphs"
    (a graph per block, each called once) or "main" (ops built in the main graph)."""
    ir = ipuxl.Ir()

    def block(x, w):
        return ops.gelu(x @ w + 1.0)

    with ir.main_graph:
        x = ops.host_load(ipuxl.h2d_stream((4, 16), F32, "x"))
        spec = ipuxl.TensorSpec((16, 16), F32)
        shared = ir.create_graph(block, x, spec)
        for i in range(blocks):
            w = ipuxl.variable(np.full((16, 16), 0.01, np.float32), name=f"w{i}")
            if style == "outlined":
                (x,) = ops.call(shared, x, w)
            elif style == "graphs":
                (x,) = ops.call(ir.create_graph(block, x, spec), x, w)
            else:
                x = block(x, w)
        ops.host_store(ipuxl.d2h_stream((4, 16), F32, "y"), x)
    return ir


@pytest.mark.parametrize("style", ["main", "graphs"])
def test_outlined_code_is_constant_in_blocks_inlined_grows_linearly(style):
    sizes = {n: estimate(block_program(n, "outlined"), SPEC).code_bytes for n in (4, 12, 48)}
    inlined = {n: estimate(block_program(n, style), SPEC).code_bytes for n in (4, 12, 48)}
    # outlined: host load/store + the block's 3 ops once, plus one small call per block
    assert sizes == {n: 5 * 8 * KiB + n * 256 for n in (4, 12, 48)}
    # inlined: 3 ops per block
    assert inlined == {n: (2 + 3 * n) * 8 * KiB for n in (4, 12, 48)}
    assert inlined[48] - inlined[4] == 44 * 3 * 8 * KiB
    assert sizes[48] - sizes[4] == 44 * 256
    assert sizes[48] < inlined[4]


def test_inlined_blocks_run_out_of_code_memory_where_outlined_fits(monkeypatch):
    monkeypatch.delenv("IPUXL_IPU_MEMORY_MIB", raising=False)
    with use_spec(IpuSpec(tiles=1, bytes_per_tile=1 * MiB)):
        with pytest.raises(OutOfMemoryError) as info:
            ipuxl.Session(block_program(48, "main"), "ipu_model")
        message = str(info.value)
        assert "146 op instances" in message and "fix: (1) outline repeated blocks" in message
        assert "ipuxl.passes.outline" in message and "recompute" not in message
        ir = block_program(48, "outlined")
        with ipuxl.Session(ir, "ipu_model") as session:
            out = session.run({ir.get_all_h2d_streams()[0]: np.ones((4, 16), np.float32)})
        reference = block_program(48, "main")
        with ipuxl.Session(reference, "cpu") as session:
            expected = session.run({reference.get_all_h2d_streams()[0]: np.ones((4, 16), np.float32)})
        np.testing.assert_allclose(out[ir.get_all_d2h_streams()[0]],
                                   expected[reference.get_all_d2h_streams()[0]], rtol=1e-6)


def test_existing_example_fits_the_default_ipu():
    from benchmarks.program_report import mlp_training_ir

    result = estimate(mlp_training_ir(batch_size=8), SPEC)
    assert result.fits
    assert result.variable_bytes == 4 * (784 * 512 + 512 + 2 * (512 * 512 + 512) + 512 * 10 + 10)
    assert dataclasses.replace(SPEC, memory_bytes_override=result.total_bytes - 1).memory_bytes < result.total_bytes
