"""popxl.addons' ``InputStreams``/``OutputStreams`` (``addons_compat.streams``): named host streams,
against eager torch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops
from ipuxl.errors import InvalidArgumentError

rng = np.random.default_rng(0)


def test_input_and_output_streams_by_name():
    ir = ipuxl.Ir()
    with ir.main_graph:
        inputs = addons.InputStreams(x=((2, 3), ipuxl.float32), n=((2,), ipuxl.int32))
        outputs = addons.OutputStreams(y=((2, 3), ipuxl.float32))
        y = ops.host_load(inputs.x) * 2.0 + ops.cast(ops.host_load(inputs.n), ipuxl.float32).reshape((2, 1))
        ops.host_store(outputs.y, y)
        again = addons.InputStreams.from_streams([inputs.x, inputs.n])
    assert list(inputs.keys()) == ["x", "n"] and inputs.x.shape == (2, 3) and inputs.n.dtype == ipuxl.int32
    assert again.x is inputs.x and again.n is inputs.n
    with pytest.raises(AttributeError, match="No attribute 'z'. Available Keys:\n    x\n    n"):
        inputs.z
    with pytest.raises(InvalidArgumentError, match="expected HostToDeviceSt"):
        addons.InputStreams.from_streams([outputs.y])
    x = rng.standard_normal((2, 3)).astype(np.float32)
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run({inputs.x: x, inputs.n: np.array([1, 2], np.int32)})
    assert_close(torch.from_numpy(out[outputs.y]), torch.from_numpy(x) * 2 + torch.tensor([[1.0], [2.0]]))
