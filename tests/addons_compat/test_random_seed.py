"""popxl.addons' seed variables (``addons_compat.random_seed``): one seed per replica group."""
from __future__ import annotations

import numpy as np

import ipuxl
import ipuxl.addons_compat as addons
import ipuxl.ops as ops


def test_seed_variable_shares_a_seed_within_each_replica_group():
    ir = ipuxl.Ir(replication=4)
    tp_group = ir.replica_grouping(group_size=2)
    with ir.main_graph:
        seed_v, seed = addons.seed_variable(1984, tp_group)
        d2h = ipuxl.d2h_stream(seed.shape, seed.dtype, "seed")
        ops.host_store(d2h, seed)
    assert seed.shape == (2,) and seed.dtype == ipuxl.uint32
    with ipuxl.Session(ir, "cpu") as session:
        output = session.run()[d2h].reshape(2, 2, 2)  # (group, replica in group, seed)
    for a, b in output:
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(output[0, 0], output[1, 0])
    np.testing.assert_array_equal(session.get_tensor_data(seed_v), output[:, 0, :])
    np.testing.assert_array_equal(output[:, 0, :], ipuxl.create_seeds(1984, replicas=2))
