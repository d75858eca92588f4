"""Run a main graph once and return what it stored (the tests' one device helper)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

import ipuxl
import ipuxl.ops as ops


def run(build: Callable[[], dict[str, Any]], replication: int = 1) -> dict[str, np.ndarray]:
    """Call ``build()`` inside a fresh main graph; host-store every tensor it returns.

    A returned ``Variable`` is read back with ``session.get_tensor_data`` instead.
    """
    ir = ipuxl.Ir(replication=replication)
    streams, variables = {}, {}
    with ir.main_graph:
        for key, tensor in build().items():
            if isinstance(tensor, ipuxl.Variable):
                variables[key] = tensor
                continue
            streams[key] = ipuxl.d2h_stream(tensor.shape, tensor.dtype, key)
            ops.host_store(streams[key], tensor)
    with ipuxl.Session(ir, "cpu") as session:
        out = session.run({})
        result = {key: out[s] for key, s in streams.items()}
        result.update({key: session.get_tensor_data(v) for key, v in variables.items()})
    return result
