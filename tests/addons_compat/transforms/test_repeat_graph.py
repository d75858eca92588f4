"""popxl.addons' ``repeat_graph`` (``addons_compat.transforms.repeat_graph``): a graph's ops in a
device loop, against an eager loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.ops as ops
from ipuxl.errors import InvalidArgumentError

rng = np.random.default_rng(0)


def test_repeat_graph_runs_the_main_graph_as_a_device_loop():
    """Each iteration loads the next slice, updates the variable in place and stores it: as an eager loop."""
    from ipuxl.addons_compat.transforms.repeat_graph import repeat_graph

    steps = 3
    x_np = rng.standard_normal((steps, 4)).astype(np.float32)
    w0 = rng.standard_normal(4).astype(np.float32)
    ir = ipuxl.Ir()
    ir.num_host_transfers = steps
    with ir.main_graph, ipuxl.in_sequence():
        x_stream = ipuxl.h2d_stream((4,), ipuxl.float32, "x")
        w = ipuxl.variable(w0, name="w")
        ops.scaled_add_(w, ops.host_load(x_stream) * w, b=0.5)
        w_stream = ipuxl.d2h_stream((4,), ipuxl.float32, "w_out")
        ops.host_store(w_stream, w + 0.0)
    assert repeat_graph(ir.main_graph, 1) is ir.main_graph
    body = repeat_graph(ir.main_graph, steps)
    assert body is not ir.main_graph and len(body.inputs) >= 1 and body.is_input_modified(body.inputs[0])
    with ipuxl.Session(ir, "cpu") as session:
        stored = session.run({x_stream: x_np})[w_stream]
    w_t, expected = torch.from_numpy(w0.copy()), []
    for step in range(steps):
        w_t = w_t + 0.5 * torch.from_numpy(x_np[step]) * w_t
        expected.append(w_t)
    assert_close(torch.from_numpy(stored), torch.stack(expected))
    assert_close(torch.from_numpy(session.get_tensor_data(w)), expected[-1])


def test_repeat_graph_refuses_a_graph_with_outputs():
    from ipuxl.addons_compat.transforms.repeat_graph import repeat_graph

    ir = ipuxl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(lambda x: x * 2.0, ipuxl.TensorSpec((2,), ipuxl.float32))
    with pytest.raises(InvalidArgumentError, match="has outputs"):
        repeat_graph(graph, 2)
