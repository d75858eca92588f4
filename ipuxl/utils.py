"""PopXL's ``popxl.utils``: host-data helpers (``to_numpy``, ``downcast_np_dtypes``)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ipuxl import dtypes

__all__ = ["to_numpy", "downcast_np_dtypes"]

#: What ``downcast=True`` turns 64-bit host data into (PopXL's table).
downcast_np_dtypes = {
    np.dtype("int64"): np.dtype("int32"),
    np.dtype("uint64"): np.dtype("uint32"),
    np.dtype("float64"): np.dtype("float32"),
}


def to_numpy(x: Any, dtype: Any = None, downcast: bool = True, copy: bool = True,
             log2_scale: int | None = None, nan_on_overflow: bool | None = None) -> np.ndarray:
    """Host data as a C-ordered numpy array, as PopXL's ``popxl.utils.to_numpy``.

    Args:
        x: a numpy array, torch tensor (bfloat16 reads as float32), or anything
            ``np.asarray`` takes.
        dtype: the dtype to convert to (PopXL, torch or numpy dtype, or a name);
            default: ``x``'s own.
        downcast: without ``dtype``, 64-bit data becomes 32-bit (``downcast_np_dtypes``).
        copy: always return a new array (otherwise ``x`` itself when it already fits).
        log2_scale, nan_on_overflow: PopXL's float8 options; ipuxl has no float8.

    Raises:
        UnsupportedError: (a RuntimeError) ``log2_scale`` or ``nan_on_overflow`` is set.
        DtypeError: (a ValueError) ``dtype`` names no dtype.
    """
    dtypes.float8_options_unset("to_numpy", log2_scale, nan_on_overflow)
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    if dtype is not None:
        target = dtypes.to_numpy_dtype(dtypes.dtype.as_dtype(dtype))
        array = np.asarray(x, dtype=target, order="C")
    else:
        array = np.asarray(x, order="C")
        if downcast and array.dtype in downcast_np_dtypes:
            return np.array(array, dtype=downcast_np_dtypes[array.dtype], order="C")
    if copy and (array is x or np.shares_memory(array, np.asarray(x))):
        array = array.copy()
    return array
