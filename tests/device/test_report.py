"""``ipuxl.device.report``: op histograms, code size, call sites, memory and FLOPs of a program
(the MLP demo and its command line: ``benchmarks/program_report.py``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ipuxl
import ipuxl.ops as ops
from ipuxl.device.resources import IpuSpec
from ipuxl.device.report import ProgramReport, format_flops, program_report

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the demo model lives with the benchmarks, outside the package
from benchmarks.program_report import mlp_training_ir  # noqa: E402

F32 = ipuxl.float32
KiB = 1024
SPEC = IpuSpec()


def matmul_program(m: int, k: int, n: int, num_host_transfers: int = 1, replication: int = 1) -> ipuxl.Ir:
    """A device loop of ``num_host_transfers`` steps: load x, store ``x @ w``."""
    ir = ipuxl.Ir(replication=replication)
    ir.num_host_transfers = num_host_transfers
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((m, k), F32, "x")
        y_stream = ipuxl.d2h_stream((m, n), F32, "y")
        w = ipuxl.variable(np.ones((k, n), np.float32), name="w")
        step = ir.create_graph(lambda w: ops.host_store(y_stream, ops.host_load(x_stream) @ w), w)
        ops.repeat(step, num_host_transfers, w)
    return ir


def test_matmul_flops_are_2mnk_per_step():
    m, k, n = 8, 16, 4
    report = program_report(matmul_program(m, k, n, num_host_transfers=5, replication=2), SPEC)
    assert report.flops_per_step == 2 * m * n * k
    assert report.flops_per_device_iteration == 2 * m * n * k
    assert report.flops_per_run == 5 * 2 * m * n * k
    assert report.flops_per_run_all_replicas == 2 * 5 * 2 * m * n * k
    assert report.graph("main_graph").op_counts == {"repeat": 1}
    body = report.graph(report.graphs[1].name)
    assert body.compiled_as == "loop body" and body.flops == 2 * m * n * k
    assert body.op_counts == {"host_load": 1, "matmul": 1, "host_store": 1}
    assert body.code_ops == 3 and body.code_bytes == 3 * 8 * KiB
    assert report.memory.variable_bytes == k * n * 4


def test_elementwise_and_conv_flops():
    ir = ipuxl.Ir()
    with ir.main_graph:
        img = ops.host_load(ipuxl.h2d_stream((1, 3, 8, 8), F32, "img"))
        weight = ipuxl.variable(np.ones((4, 3, 3, 3), np.float32), name="weight")
        y = ops.conv(img, weight)                      # (1, 4, 6, 6)
        z = ops.gelu(y) + 1.0                          # 2 x 144 elementwise
        ops.host_store(ipuxl.d2h_stream((), F32, "s"), ops.sum(ops.reshape(z, (144,))))  # view: 0, sum: 144
    report = program_report(ir, SPEC)
    assert report.flops_per_step == 2 * 144 * (3 * 3 * 3) + 144 + 144 + 144
    assert report.graph("main_graph").op_counts["reshape"] == 1
    assert report.graph("main_graph").code_ops == 6  # the reshape is a view: no code


def test_call_sites_and_executed_flops_of_called_graphs():
    ir = ipuxl.Ir()

    def body(a, w):
        return ops.gelu(a @ w)

    with ir.main_graph:
        x = ops.host_load(ipuxl.h2d_stream((4, 8), F32, "x"))
        w = ipuxl.variable(np.eye(8, dtype=np.float32), name="w")
        graph = ir.create_graph(body, x, w)
        once = ir.create_graph(lambda a: a * 2.0, x)
        unused = ir.create_graph(lambda a: a - 1.0, x)
        (y,) = ops.call(graph, x, w)
        (y,) = ops.call(graph, y, w)
        (y,) = ops.repeat(graph, 3, y, w)
        (y,) = ops.call(once, y)
        ops.host_store(ipuxl.d2h_stream((4, 8), F32, "y"), y)
    report = program_report(ir, SPEC)
    body_report = report.graph(graph.name)
    assert body_report.compiled_as == "outlined"
    assert [(s.caller, s.kind, s.count) for s in body_report.call_sites] == \
        [("main_graph", "call", 1), ("main_graph", "call", 1), ("main_graph", "repeat", 3)]
    assert body_report.executions_per_step == 5
    body_flops = 2 * 4 * 8 * 8 + 4 * 8
    assert body_report.flops == body_flops
    assert report.graph(once.name).compiled_as == "inlined"
    assert report.graph(unused.name).compiled_as == "not compiled"
    assert report.graph(unused.name).code_bytes == 0 and report.graph(unused.name).call_sites == []
    assert report.flops_per_step == 5 * body_flops + 4 * 8
    # code: main (load, store) + body (matmul, gelu) once + once (mul); 3 calls of the outlined body
    assert report.code_bytes == 5 * 8 * KiB + 3 * 256
    assert report.graph("main_graph").op_counts == {"host_load": 1, "host_store": 1, "call": 3, "repeat": 1}

    text = str(report)
    for fragment in ["main_graph", graph.name, once.name, unused.name, "outlined", "inlined", "not compiled",
                     "total (compiled)", "Call sites:", f"{graph.name} <- main_graph x3", "repeat x3",
                     "Op types:", "Memory per IPU", "variables:", "peak activations:", "FLOPs:",
                     f"{report.flops_per_step:,}", "per Session.run"]:
        assert fragment in text, f"{fragment!r} not in:\n{text}"


def test_report_table_is_aligned():
    text = str(program_report(mlp_training_ir(blocks=3, outlined=True), SPEC))
    table = text.split("\n\n")[1].splitlines()
    assert table[0].startswith("graph") and table[-1].startswith("total (compiled)")
    assert len({len(line.rstrip()) for line in table[:-2]}) == 1  # graph rows and header end in one column


def test_session_report_matches_program_report():
    ir = matmul_program(2, 3, 4)
    session = ipuxl.Session(ir, "cpu")
    report = session.report(SPEC)
    assert isinstance(report, ProgramReport)
    assert report.flops_per_step == program_report(ir, SPEC).flops_per_step == 2 * 2 * 3 * 4
    assert report.memory.total_bytes == program_report(ir, SPEC).memory.total_bytes


def test_mlp_example_outlined_code_is_constant_in_blocks():
    inlined = {n: program_report(mlp_training_ir(blocks=n), SPEC) for n in (2, 8)}
    outlined = {n: program_report(mlp_training_ir(blocks=n, outlined=True), SPEC) for n in (2, 8)}
    assert inlined[8].code_bytes - inlined[2].code_bytes > 6 * 7 * 8 * KiB
    # outlined: per extra block only its calls (forward, backward) and its 2 SGD updates in main
    assert outlined[8].code_bytes - outlined[2].code_bytes == 6 * (2 * 256 + 2 * 8 * KiB)
    assert outlined[8].flops_per_step == inlined[8].flops_per_step  # same work either way
    seed_002 = inlined[2]  # 784-512-512-512-10, batch 8
    matmul = 2 * 8 * (784 * 512 + 2 * 512 * 512 + 512 * 10)
    assert 3 * matmul <= seed_002.flops_per_step < 3.1 * matmul  # forward + 2 backward matmuls per layer


def test_format_flops():
    assert format_flops(512) == "512 FLOP"
    assert format_flops(2.5e9) == "2.500 GFLOP"


def test_program_report_script_runs_from_anywhere(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = ROOT / "benchmarks" / "program_report.py"
    result = subprocess.run([sys.executable, str(script), "--blocks", "3", "--outlined"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for fragment in ["Program report", "main_graph", "Linear_subgraph", "outlined", "x3", "total (compiled)",
                     "Memory per IPU", "fits", "FLOPs:", "per step"]:
        assert fragment in out, f"{fragment!r} not in:\n{out}"
