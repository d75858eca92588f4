"""popxl.addons' ``LayerNorm``: ``torch_mapping`` takes a ``torch.nn.LayerNorm``'s weights,
and the layer then computes what torch's does."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons

rng = np.random.default_rng(0)


@pytest.mark.parametrize("normalised", [(6,), (2, 3, 4)], ids=["one axis", "three axes"])
def test_torch_mapping_gives_torchs_layer_norm(normalised):
    """A layer over several axes maps to the flattened ``(N, prod)`` layer, as upstream's test does."""
    x_np = rng.standard_normal((3, *normalised)).astype(np.float32)
    torch_layer = torch.nn.LayerNorm(list(normalised))
    with torch.no_grad():
        torch_layer.weight.uniform_(0.5, 1.5)
        torch_layer.bias.uniform_(-0.5, 0.5)
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.constant(x_np.reshape(3, -1), name="x")
        facts, graph = addons.LayerNorm().create_graph(x)
        variables = facts.init()
        (y,) = graph.bind(variables).call(x)
        stream = addons.host_store(y)
    weights = addons.LayerNorm.torch_mapping(variables, torch_layer)
    assert isinstance(weights, addons.WeightsDict)
    assert weights[variables.weight].shape == (int(np.prod(normalised)),)
    assert weights[variables.weight].dtype == np.float32
    with ipuxl.Session(ir, "cpu") as session:
        session.write_variables_data(weights)
        got = torch.from_numpy(session.run()[stream])
    expected = torch_layer(torch.from_numpy(x_np)).detach().reshape(3, -1)
    assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_torch_mapping_converts_to_the_dtype_asked():
    ir = ipuxl.Ir()
    with ir.main_graph:
        x = ipuxl.constant(np.zeros((2, 4), np.float16), name="x")
        facts, _ = addons.LayerNorm().create_graph(x)
        variables = facts.init()
    weights = addons.LayerNorm.torch_mapping(variables, torch.nn.LayerNorm(4), ipuxl.float16)
    assert weights[variables.bias].dtype == np.float16
    with pytest.raises(ValueError, match="dtypes do not equal"):  # WeightsDict checks the variables' dtype
        addons.LayerNorm.torch_mapping(variables, torch.nn.LayerNorm(4))
