"""popxl.addons' ``testing_utils``: ``run_module`` runs a layer with given weights."""
from __future__ import annotations

import numpy as np
import torch
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons
from ipuxl.addons_compat.testing_utils import TensorInput, run_module

rng = np.random.default_rng(0)


def test_run_module_runs_a_layer_with_given_weights():
    x_np = rng.standard_normal((3, 4)).astype(np.float32)
    torch_linear = torch.nn.Linear(4, 2)
    (y,) = run_module(addons.Linear(2), TensorInput(x_np, ipuxl.float32),
                      weights=lambda v: {v.weight: torch_linear.weight.detach().numpy().T,
                                         v.bias: torch_linear.bias.detach().numpy()})
    assert_close(torch.from_numpy(y), torch_linear(torch.from_numpy(x_np)).detach())
    (z,) = run_module(addons.Linear(2, bias=False), TensorInput(x_np))  # dtype from the data
    assert z.shape == (3, 2) and z.dtype == np.float32
