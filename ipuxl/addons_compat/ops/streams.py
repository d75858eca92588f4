"""popxl.addons' ``host_load``/``host_store``: a host stream and its transfer op in one call."""
from __future__ import annotations

from typing import Any

import numpy as np

from ipuxl.dtypes import dtype as Dtype
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream, d2h_stream, h2d_stream
from ipuxl.ir.tensor import Tensor
from ipuxl.ops import host
from ipuxl.utils import to_numpy

__all__ = ["host_load", "host_store"]


def host_load(t: Any, dtype: Any, name: str) -> tuple[np.ndarray, HostToDeviceStream, Tensor]:
    """A stream ``<name>_stream`` shaped like host data ``t`` and the tensor loaded from it.

    Returns:
        ``t`` as a numpy array of ``dtype`` (the data to feed), the stream, the loaded tensor.
    """
    stream = h2d_stream(np.shape(t), dtype, name=f"{name}_stream")
    return to_numpy(t, dtype=Dtype.as_dtype(dtype).as_numpy()), stream, host.host_load(stream, name)


def host_store(t: Tensor) -> DeviceToHostStream:
    """A stream ``<t.name>_stream`` of ``t``'s shape and dtype, and a ``host_store`` of ``t`` to it."""
    stream = d2h_stream(t.shape, t.dtype, name=f"{t.name}_stream")
    host.host_store(stream, t)
    return stream
