"""Placement on several IPUs: ``ipuxl.ipu(n)``, ``ops.ipu_copy``, ``Tensor.copy_to_ipu``, I/O tiles,
the placement check (PopART's refusal of a cross-IPU read without a copy) and per-IPU memory."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.device.resources import IpuSpec, MiB, use_spec
from ipuxl.errors import OutOfMemoryError, PlacementError
from ipuxl.ir.meta import IPU

rng = np.random.default_rng(18)


def _run(ir: ipuxl.Ir, inputs: dict | None = None, device: str = "ipu_model") -> dict:
    with ipuxl.Session(ir, device) as session:
        return session.run(inputs or {})


def test_ops_and_variables_record_the_ipu_of_their_context():
    ir = ipuxl.Ir()
    with ir.main_graph:
        a = ipuxl.variable(np.ones(3, np.float32), name="a")
        with ipuxl.ipu(2):
            b = ipuxl.variable(np.ones(3, np.float32), name="b")
            c = b * 2
            with ipuxl.ipu(1):
                d = ipuxl.variable(np.ones(3, np.float32), name="d")
    assert IPU not in a.node.meta  # absent means IPU 0
    assert (b.node.meta[IPU], c.node.meta[IPU], d.node.meta[IPU]) == (2, 2, 1)
    assert ir.num_ipus == 3
    assert ipuxl.Ir().num_ipus == 1


def test_reading_a_tensor_of_another_ipu_without_a_copy_is_refused():
    ir = ipuxl.Ir()
    with ir.main_graph:
        with ipuxl.ipu(0):
            x = ipuxl.variable(np.ones(3, np.float32), name="x")
            y = ops.mul(x, 2.0)
        with ipuxl.ipu(1):
            with pytest.raises(PlacementError, match=r"IPU 1.*'mul'.*IPU 0") as caught:
                ops.add(y, 1.0)
            with pytest.raises(ValueError, match="variable|'x'.*IPU 0"):
                ops.relu(x)
    assert "ipu_copy" in str(caught.value) and "test_placement.py" in str(caught.value)


def test_an_ipu_id_must_be_a_non_negative_int():
    with pytest.raises(PlacementError, match="int >= 0"):
        with ipuxl.ipu(-1):
            pass
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ops.mul(ipuxl.variable(np.ones(2, np.float32)), 2.0)
        with pytest.raises(PlacementError, match="destination"):
            ops.ipu_copy(x, "1")  # type: ignore[arg-type]


def test_ipu_copy_and_copy_to_ipu_give_the_values_on_the_destination():
    x_np = rng.standard_normal((2, 3)).astype(np.float32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        stream = ipuxl.h2d_stream((2, 3), ipuxl.float32, "x")
        out = ipuxl.d2h_stream((2, 3), ipuxl.float32, "out")
        with ipuxl.ipu(0):
            x = ops.host_load(stream)
            y = ops.ipu_copy(ops.exp(x), 1)
        with ipuxl.ipu(1):
            z = (y * 3.0).copy_to_ipu(2)
        with ipuxl.ipu(2):
            ops.host_store(out, ops.io_tile_copy(z) - 1.0)
    assert (y.node.meta[IPU], z.node.meta[IPU]) == (1, 2)
    result = _run(ir, {stream: x_np})[out]
    assert_close(torch.from_numpy(result), torch.exp(torch.from_numpy(x_np)) * 3 - 1)


def test_ipu_copy_source_is_inferred_or_checked():
    ir = ipuxl.Ir()
    with ir.main_graph:
        with ipuxl.ipu(1):
            x = ops.mul(ipuxl.variable(np.ones(2, np.float32)), 2.0)
        with pytest.raises(PlacementError, match="lives on IPU 1"):
            ops.ipu_copy(x, 0, source=0)

    def body(t: ipuxl.Tensor) -> ipuxl.Tensor:
        return ops.ipu_copy(t, 1)  # a graph input has no producer: its IPU is unknown

    with ir.main_graph, pytest.raises(ValueError, match="Could not infer the ipu"):
        ir.create_graph(body, ipuxl.TensorSpec((2,), ipuxl.float32))


def test_io_tiles_context_is_accepted_and_runs_on_the_same_ipu():
    ir = ipuxl.Ir()
    with ir.main_graph:
        out = ipuxl.d2h_stream((2,), ipuxl.float32, "out")
        with ipuxl.ipu(1), ipuxl.io_tiles():
            v = ipuxl.variable(np.array([1.0, 2.0], np.float32), name="v")
            y = ops.io_tile_copy(v) + 1.0
            ops.host_store(out, y)
    assert y.node.meta[IPU] == 1
    assert_close(torch.from_numpy(_run(ir)[out]), torch.tensor([2.0, 3.0]))


def test_gradient_through_an_ipu_copy_is_the_identity():
    """A subgraph whose ops span two IPUs, differentiated: the gradient of eager PyTorch."""
    x_np = rng.standard_normal(4).astype(np.float32)

    def f(x: ipuxl.Tensor) -> ipuxl.Tensor:
        with ipuxl.ipu(0):
            h = ops.ipu_copy(ops.sin(x), 1, source=0)
        with ipuxl.ipu(1):
            return h * h

    ir = ipuxl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(f, ipuxl.TensorSpec((4,), ipuxl.float32))
        grad_info = ipuxl.transforms.autodiff(graph)
        x = ipuxl.constant(x_np, name="x")
        info = ops.call_with_info(graph, x)
        (dx,) = ops.call(grad_info.graph, ipuxl.constant(np.ones(4, np.float32)),
                         inputs_dict=grad_info.inputs_dict(info))
        out = ipuxl.d2h_stream((4,), ipuxl.float32, "dx")
        ops.host_store(out, dx)
    xt = torch.from_numpy(x_np).requires_grad_()
    (torch.sin(xt) ** 2).sum().backward()
    assert_close(torch.from_numpy(_run(ir, device="cpu")[out]), xt.grad)


def test_a_call_outside_every_ipu_context_may_read_and_give_tensors_of_several_ipus():
    """Its graph's ops carry their own placement (popxl.addons' within-replica sharded ops);
    inside an ``ipu(n)`` context a call is an op of IPU n and is checked like any other."""
    def add(a: ipuxl.Tensor, b: ipuxl.Tensor) -> tuple[ipuxl.Tensor, ipuxl.Tensor]:
        return a + b, a - b

    ir = ipuxl.Ir()
    with ir.main_graph:
        with ipuxl.ipu(0):
            a = ipuxl.variable(np.array([1.0, 2.0], np.float32)) + 0
        with ipuxl.ipu(1):
            b = ipuxl.variable(np.array([3.0, 5.0], np.float32)) + 0
        graph = ir.create_graph(add, a, b)
        with ipuxl.ipu(0), pytest.raises(PlacementError, match=r"'call'.*IPU 0.*IPU 1"):
            ops.call(graph, a, b)
        total, difference = ops.call(graph, a, b)
        outs = []
        for ipu, t in ((0, total), (1, difference)):
            with ipuxl.ipu(ipu):
                outs.append(ipuxl.d2h_stream(t.shape, t.dtype, f"out{ipu}"))
                ops.host_store(outs[-1], t)
    got = _run(ir)
    assert_close(torch.from_numpy(got[outs[0]]), torch.tensor([4.0, 7.0]))
    assert_close(torch.from_numpy(got[outs[1]]), torch.tensor([-2.0, -3.0]))


def _two_ipu_program(mib_0: float, mib_1: float) -> ipuxl.Ir:
    ir = ipuxl.Ir()
    with ir.main_graph:
        with ipuxl.ipu(0):
            a = ipuxl.variable(np.zeros(int(mib_0 * MiB) // 4, np.float32), name="a")
            s = ops.ipu_copy(ops.reduce_sum(a), 1)
        with ipuxl.ipu(1):
            b = ipuxl.variable(np.zeros(int(mib_1 * MiB) // 4, np.float32), name="b")
            ops.host_store(ipuxl.d2h_stream((), ipuxl.float32, "s"), s + ops.reduce_sum(b))
    return ir


def test_each_ipu_has_its_own_memory():
    """1 MiB of variables on each of two IPUs of 1.5 MiB fits (2 MiB would not fit one IPU)."""
    spec = IpuSpec(code_bytes_per_op=0, memory_bytes_override=int(1.5 * MiB))
    ir = _two_ipu_program(1, 1)
    with use_spec(spec):
        with ipuxl.Session(ir, "ipu_model") as session:
            report = session.report()
            assert session.num_ipus == 2
    usage = [report.ipus.usage(i) for i in range(2)]
    assert [u.variable_bytes for u in usage] == [MiB, MiB]
    assert report.ipus.copies == {(0, 1): 4} and (usage[0].copy_out_bytes, usage[1].copy_in_bytes) == (4, 4)
    assert usage[0].flops > 0 and usage[1].flops > 0
    assert "IPU 0 -> IPU 1" in str(report)


def test_out_of_memory_names_the_ipu_that_does_not_fit():
    spec = IpuSpec(code_bytes_per_op=0, memory_bytes_override=int(1.5 * MiB))
    with use_spec(spec), pytest.raises(OutOfMemoryError, match=r"IPU 1 of 2 is out of memory") as caught:
        ipuxl.Session(_two_ipu_program(1, 2), "ipu_model")
    assert "IPU 1" in caught.value.fix and isinstance(caught.value, MemoryError)
    with use_spec(spec):  # device "cpu" has no memory limit
        ir = _two_ipu_program(1, 2)
        (total,) = _run(ir, device="cpu").values()
    assert float(total) == 0.0


def test_a_one_ipu_program_reports_no_per_ipu_section():
    ir = ipuxl.Ir()
    with ir.main_graph:
        ops.host_store(ipuxl.d2h_stream((2,), ipuxl.float32, "y"), ipuxl.variable(np.ones(2, np.float32)) * 2.0)
    with ipuxl.Session(ir, "ipu_model") as session:
        report = session.report()
        assert session.num_ipus == 1
    assert report.ipus is None and "IPUs:" not in str(report)


def test_a_variable_built_outside_every_ipu_context_lives_where_it_is_read():
    ir = ipuxl.Ir()
    with ir.main_graph:
        w = ipuxl.variable(np.ones(3, np.float32), name="w")  # unplaced, as PopART places it by its readers
        with ipuxl.ipu(1):
            y = w * 2.0
            ops.host_store(ipuxl.d2h_stream((3,), ipuxl.float32, "y"), y)
        with pytest.raises(PlacementError, match="source"):
            ops.ipu_copy(w, 0)  # no producer to infer the source IPU from
    with ipuxl.Session(ir, "ipu_model") as session:
        assert session.report().ipus.usage(1).variable_bytes == 12
