"""Variables whose host data is a memory-mapped file (``np.memmap``), as PopXL keeps them.

PopXL does not copy a memmap given as a variable's data: the file is the variable's host
buffer, ``Session.weights_to_host`` writes the device's values into it and flushes it, and
``Session.get_tensor_data`` returns the very memmap object. That only works when the
array can be used as it is, so PopXL refuses (``ValueError``) a memmap that would need a
conversion: another dtype asked for, a 64-bit dtype (the device would need it downcast),
or a layout that is not C order.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ipuxl import dtypes
from ipuxl.errors import InvalidValueError
from ipuxl.ir import context

__all__ = ["check_memmap", "warn_non_const_grouping"]

_log = logging.getLogger("ipuxl.memmap")


def check_memmap(data: Any, dtype: Any, subject: str) -> None:
    """Refuse, as PopXL does, a memmap ``data`` that a variable could not keep as its host buffer.

    Raises:
        InvalidValueError: (a ValueError) ``dtype`` differs from the memmap's, the memmap's
            dtype is 64-bit, or it is not C-ordered.
    """
    if not isinstance(data, np.memmap):
        return
    where = context.user_source_line()
    own = dtypes.from_any(data.dtype, subject)
    if dtypes.DOWNCAST.get(own) is not None:
        raise InvalidValueError(
            f"When passing a memory-mapped NumPy array, the dtype {dtype} is not supported, as it requires "
            f"downcasting to 32 bits ({subject}: the array is {data.dtype})", where=where,
            fix="store the file as float32/int32 (np.memmap(..., dtype=np.float32)) and map that")
    if dtype is not None and dtypes.from_any(dtype, subject) != own:
        raise InvalidValueError(
            f"When passing a memory-mapped NumPy array, the `dtype` parameter must be None or the array's own "
            f"dtype ({subject}: the array is {data.dtype}, dtype={dtype}): the file is the variable's host buffer "
            "and is not converted", where=where, fix="pass dtype=None, or map the file with the dtype you want")
    if data.ndim > 1 and not data.flags.c_contiguous:
        raise InvalidValueError(
            f"When passing a memory-mapped NumPy array, it must already be in C-ordered (row-major) layout "
            f"({subject}: the array is not C-contiguous)", where=where,
            fix="map the file with order='C' (np.memmap(..., order='C'))")


def warn_non_const_grouping(data: Any, grouping: Any) -> None:
    """PopXL's warning for a memmap variable with a replica grouping that is not a regular
    stride/size pattern: its groups' rows are read from the file in the grouping's order."""
    if isinstance(data, np.memmap) and grouping is not None and not getattr(grouping, "is_const", True):
        _log.warning("you have passed np.memmap data and the non-const replica grouping `%s`: each group's "
                     "value is read from (and written back to) its row of the file in group order", grouping)
