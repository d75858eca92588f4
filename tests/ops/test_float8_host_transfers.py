"""float8 host data through a Session (needs the device-layer change described in the report):
streams, variables and remote variables carry PopXL's structured float8 arrays, bit for bit."""
import numpy as np
import pytest
import torch

import ipuxl
import ipuxl.ops as ops
from ipuxl import fp8_utils
from ipuxl.dtypes import float8_143, float8_152


@pytest.mark.parametrize("dtype", [float8_143, float8_152])
def test_float8_streams_and_variables_carry_the_bits(dtype):
    data = fp8_utils.host_pow2scale_cast_to_fp8(np.random.default_rng(0).normal(size=(3, 4)) * 10, dtype)
    ir = ipuxl.Ir()
    with ir.main_graph:
        x_stream = ipuxl.h2d_stream((3, 4), dtype, "x")
        x = ops.host_load(x_stream)
        w = ipuxl.variable([[1.0, -2.0, 3.0, 1e9]], dtype, log2_scale=1, nan_on_overflow=False, name="w")
        buffer = ipuxl.remote_buffer((4,), dtype, 1)
        r = ipuxl.remote_variable(data[0], buffer, 0)
        loaded = ops.remote_load(buffer, 0)
        y_stream = ipuxl.d2h_stream((3, 4), dtype, "y")
        ops.host_store(y_stream, ops.concat([ops.slice(x, start=0, stop=2, axis=0), ops.reshape(loaded, (1, 4))]))
    with ipuxl.Session(ir, "ipu_model") as session:
        out = session.run({x_stream: data})[y_stream]
        assert out.dtype == dtype.as_numpy()
        np.testing.assert_array_equal(out.view(np.uint8), np.concatenate([data[:2], data[:1]]).view(np.uint8))
        expected_w = torch.tensor([[2.0, -4.0, 6.0, 2e9]]).clamp(-57344.0, 57344.0)
        expected_w = expected_w.clamp(-240.0, 240.0) if dtype == float8_143 else expected_w
        host_w = session.get_tensor_data(w)
        assert host_w.dtype == dtype.as_numpy()
        np.testing.assert_array_equal(host_w.view(np.uint8), fp8_utils.to_host(
            expected_w.to(dtype.as_torch())).view(np.uint8))
        session.write_variable_data(r, data[2])
        np.testing.assert_array_equal(session.get_tensor_data(r).view(np.uint8), data[2].view(np.uint8))
