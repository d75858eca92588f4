"""popxl.addons' top-level ``host_load``/``host_store`` (``addons_compat.ops.streams``), with
``cross_entropy``, against eager torch."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ipuxl
import ipuxl.addons_compat as addons

rng = np.random.default_rng(0)


def test_top_level_host_load_host_store_and_cross_entropy():
    logits_host = rng.standard_normal((4, 5))  # float64 host data: host_load casts it to the dtype
    labels = np.array([0, 3, 1, 4], np.int32)
    ir = ipuxl.Ir()
    with ir.main_graph:
        data, stream, logits = addons.host_load(logits_host, ipuxl.float32, "logits")
        loss = addons.cross_entropy(logits, ipuxl.constant(labels, name="labels"))
        loss_stream = addons.host_store(loss)
    assert data.dtype == np.float32 and stream.name == "logits_stream" and stream.shape == (4, 5)
    assert loss_stream.name == f"{loss.name}_stream" and loss_stream.shape == ()
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run({stream: data})[loss_stream]
    expected = F.cross_entropy(torch.from_numpy(data), torch.from_numpy(labels).long())
    assert_close(torch.tensor(out), expected)
